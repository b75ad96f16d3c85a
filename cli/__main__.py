"""`python -m moectl.cli` is `moectl`."""

from moectl.cli.main import main

main()

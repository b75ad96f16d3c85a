"""The `moectl` command line: one module per command group (generate, verify, model, bench, plan,
trace, record, console, serve), the shared options and the engine-config translation in
common.py, all registered in main.py."""

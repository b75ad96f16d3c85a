"""A KV retention budget as an operator writes it: "4096" (tokens a sequence keeps) or "25%" (of its
context), and back. The engine's knobs carry it as kv_budget (tokens, 0: none) and
kv_budget_fraction (1: none)."""

from __future__ import annotations


def parse_kv_budget(text: str, where: str = "kv budget") -> tuple[int, float]:
    """(kv_budget, kv_budget_fraction) of "N" or "P%"; ValueError naming `where` otherwise."""
    value = str(text).strip()
    try:
        if value.endswith("%"):
            percent = float(value[:-1])
            if not 0 < percent <= 100:
                raise ValueError
            return 0, percent / 100
        tokens = int(value.replace("_", "").replace(",", ""))
        if tokens < 1:
            raise ValueError
        return tokens, 1.0
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a token count (e.g. 4096) or a percentage of the context "
                         "(e.g. 25%)") from None


def format_kv_budget(tokens: int, fraction: float) -> str:
    """The budget as parse_kv_budget reads it ("none" when neither cap applies)."""
    parts = ([str(tokens)] if tokens else []) + ([f"{fraction * 100:g}%"] if fraction < 1 else [])
    return " and ".join(parts) or "none"

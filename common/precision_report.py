"""--precision-report's table, the same for both frameworks; each framework's probe
(common/pytorch/precision_report.py, common/tensorflow/precision_report.py) hands in the rows."""
from __future__ import annotations

LayerRow = tuple[str, str, str, str]  # (layer, kind, weight dtype or "-", output dtype)


def format_precision_report(rows: list[LayerRow], precision: str) -> str:
    width = max(len(f"{layer} ({kind})") for layer, kind, _, _ in rows)
    lines = [f"precision report ({precision}): layer, weight dtype, output dtype"]
    lines += [f"  {f'{layer} ({kind})':<{width}}  {weights:<9} {output}"
              for layer, kind, weights, output in rows]
    return "\n".join(lines)

"""What the benchmark scripts share."""

from __future__ import annotations

import json


def save_json(path: str | None, obj) -> None:
    """Write a result to `path` (the script's --json), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers ("0,1,2,3"), as `dflash train --swa-layers` takes them."""
    return [int(x) for x in text.split(",") if x.strip()]

"""Validators of the deployment YAML's Ray placement keys (schema.py calls them while it
validates a config): a pool's custom Ray resources (`pools.<pool>.resources` besides num_cpus and
num_gpus) and its node label selector (`pools.<pool>.label_selector`). Each returns None for a
valid value, else the message that load.py's ConfigError shows under the key; they keep no
state and start nothing (a label selector is judged by Ray's own validator, imported when one is
set).
"""

from __future__ import annotations

import math


def custom_resource_problem(name, amount) -> str | None:
    """Why `name: amount` is not a Ray custom resource a pool may ask for, or None. Names that
    start with num_ are refused as typos of num_cpus/num_gpus; CPU and GPU have those keys."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        return f"{name!r}: a custom Ray resource needs a name without surrounding spaces"
    if name in ("CPU", "GPU"):
        return f"{name}: use num_{name.lower()}s for {name}s"
    if name.startswith("num_") or name.lower() in ("cpu", "cpus", "gpu", "gpus"):
        return (
            f"{name}: unknown key (num_cpus and num_gpus are the known ones; a custom Ray "
            f"resource may not be named cpu(s), gpu(s) or start with num_)"
        )
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        return f"{name}: a custom Ray resource's amount must be a number (got {amount!r})"
    if not (math.isfinite(amount) and amount > 0):
        return f"{name}: a custom Ray resource's amount must be positive (got {amount!r})"
    if amount < 1 and round(amount * 10_000) == 0:
        return f"{name}: Ray counts resources in steps of 0.0001 (got {amount!r})"
    return None


def label_selector_problem(selector: dict) -> str | None:
    """Ray's own verdict on a label selector (None: valid), where this Ray can give one."""
    try:
        from ray._private.label_utils import validate_label_selector
    except ImportError:  # a Ray without label selectors: the launcher refuses the key
        return None
    return validate_label_selector(selector)

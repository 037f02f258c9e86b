"""The deployment YAML's keys for how the router plans where prompts run: `router.local_prefill`
(prompts a decode worker runs itself) and `planner:` (role flips and local prefill moved while
traffic shifts). deploy/config.py nests them in its schema (RouterSettings, DeployConfig) and
re-exports them; deploy/launcher.py hands them to the router. Frozen, validated once at load.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pdserve.deploy.config_files import _Frozen


class LocalPrefillSettings(_Frozen):
    """router.local_prefill (planner/local_prefill.py): prompts of at most max_prompt_tokens run on
    their decode worker when cost x (its local backlog + the prompt) < the prefill pool's backlog
    + hop_tokens. 0: never (the default)."""

    max_prompt_tokens: Annotated[int, Field(ge=0)] = 0
    cost: Annotated[float, Field(gt=0)] = 2.0
    hop_tokens: Annotated[int, Field(ge=0)] = 64


class PlannerSettings(_Frozen):
    """`planner:` (planner/policy.py): moves the prefill:decode split while traffic shifts, by
    role flips and local prefill, to keep the SLO (p90 TTFT and TPOT). Off unless enabled."""

    enabled: bool = False
    ttft_s: Annotated[float, Field(gt=0)] = 1.0
    tpot_s: Annotated[float, Field(gt=0)] = 0.1
    interval_s: Annotated[float, Field(gt=0)] = 5.0
    window_s: Annotated[float, Field(gt=0)] = 15.0
    margin: Annotated[float, Field(ge=0, lt=1)] = 0.2
    sustain: Annotated[int, Field(ge=1)] = 2
    cooldown_s: Annotated[float, Field(ge=0)] = 30.0
    max_flips_per_min: Annotated[int, Field(ge=0)] = 8
    kv_high: Annotated[float, Field(gt=0, le=1)] = 0.9
    local_step: Annotated[int, Field(ge=0)] = 64
    local_cap: Annotated[int, Field(ge=0)] = 1024  # 0: the planner never prefills locally
    prefill_use: Annotated[float, Field(gt=0, le=1)] = 0.95  # sizes a batch of flips

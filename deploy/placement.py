"""Where a pool's replicas may run on a Ray cluster: the placement-group arguments for a pool's
custom resources and node labels, and the check, made once `up` has joined or started Ray, that
some live node matches each pool's label selector.

A pool's `resources` (deploy/config/schema.py: num_cpus, num_gpus and any custom resources by name) make
each bundle of its placement group, one per rank (`strategy` says how they may spread: a worker of
one stage on one node, a pipelined one's stages on one node or several), so a replica lands only on a node that has them (a node
started with `ray start --resources '{"node2": 1}'`). Its `label_selector` applies to every bundle
(Ray's bundle_label_selector): every rank lands on a node whose labels match (`ray start --labels
zone=us-a`). Ray would wait forever for a placement no node can give, so `check_labels` refuses
at once a selector no live node matches, naming the pool and the labels the nodes have, and
`check_custom_resources` a custom resource the cluster has too little of (prechecks.check_resources
checks the CPUs and GPUs). Nothing here keeps state.
"""

from __future__ import annotations

from pdserve.deploy.config.schema import DeployConfig, Pool
from pdserve.deploy.prechecks import DeployError


def strategy(pool: Pool) -> str:
    """The placement strategy of one replica of `pool`: its ranks share a node (STRICT_PACK)
    unless it runs in pipeline stages; then PACK (one node when one holds them all, else as few
    as do: a stage may sit on another node than the one before it) or, with stage_placement
    "spread", STRICT_SPREAD (one node per rank, so per stage: tp is 1)."""
    if pool.pp == 1:
        return "STRICT_PACK"
    return "STRICT_SPREAD" if pool.stage_placement == "spread" else "PACK"


def pg_options(pool: Pool) -> dict:
    """placement_group() arguments for one replica of `pool`: one bundle of its resources per
    rank (tp x pp, rank order: bundle r holds rank r, deploy/rank_actors.py), its strategy, and
    the label selector on each bundle when it has one."""
    bundles = [dict(pool.resources.bundle()) for _ in range(pool.ranks)]
    options: dict = {"bundles": bundles, "strategy": strategy(pool)}
    if pool.label_selector:
        options["bundle_label_selector"] = [dict(pool.label_selector) for _ in bundles]
    return options


def check_custom_resources(config: DeployConfig, total: dict, local: bool) -> None:
    """Refuses pools whose custom resources the Ray cluster (`total`: ray.cluster_resources())
    does not have as much of, naming the first pool that asks for the missing one."""
    need: dict[str, float] = {}
    first: dict[str, str] = {}
    for key, pool in config.worker_pools():
        for name, amount in pool.resources.custom().items():
            need[name] = need.get(name, 0) + amount * pool.ranks * pool.replicas
            first.setdefault(name, key)
    for name, amount in need.items():
        if amount <= total.get(name, 0) + 1e-9:
            continue
        fix = (
            "a local Ray has no custom resources: join a cluster that has it (--address)"
            if local
            else f"add nodes with `ray start --address ... --resources '{{\"{name}\": N}}'`"
        )
        raise DeployError(
            f"pools.{first[name]}.resources.{name}: the pools ask for {amount:g} {name} but the "
            f"Ray cluster has {total.get(name, 0):g}; {fix}, or change pools.{first[name]}.resources"
        )


def _matches(value: str | None, selector: str) -> bool:
    """Ray's label selector on one label: "a" (equals), "!a" (not), "in(a,b)", "!in(a,b)"; an
    empty selector: the label is present."""
    negate = selector.startswith("!")
    body = selector[1:] if negate else selector
    if body.startswith("in(") and body.endswith(")"):
        hit = value in {v.strip() for v in body[3:-1].split(",")}
    elif body == "":
        hit = value is not None
    else:
        hit = value == body
    return not hit if negate else hit


def node_matches(labels: dict, selector: dict) -> bool:
    return all(_matches(labels.get(k), v) for k, v in selector.items())


def _shown(labels: dict) -> str:
    own = {k: v for k, v in labels.items() if not k.startswith("ray.io/")}
    return ", ".join(f"{k}={v}" for k, v in sorted(own.items())) or "no labels of their own"


def check_labels(config: DeployConfig, nodes: list[dict]) -> None:
    """Refuses a pool whose label_selector no live node of `nodes` (ray.nodes()) matches."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    for key, pool in config.worker_pools():
        if not pool.label_selector:
            continue
        if any(node_matches(n.get("Labels") or {}, pool.label_selector) for n in alive):
            continue
        wanted = ", ".join(f"{k}={v}" for k, v in pool.label_selector.items())
        seen = "; ".join(sorted({_shown(n.get("Labels") or {}) for n in alive})) or "no nodes"
        raise DeployError(
            f"pools.{key}.label_selector: no live Ray node has labels matching {wanted} (the "
            f"nodes have: {seen}); start one with `ray start --labels KEY=VALUE`, or change "
            f"pools.{key}.label_selector"
        )

"""Choosing nodes for a pool and joining a Ray cluster, without Ray running: the YAML keys
(pools.<pool>.resources with Ray custom resources, pools.<pool>.label_selector, ray.dashboard)
and their refusals, the placement group each replica asks for, the refusal of a selector no node
matches (deploy/placement.py), and how `up --address` finds the cluster's token and what it says
when it cannot (deploy/ray_join.py, its GCS probe replaced by a fake). A real two-node cluster:
tests/e2e/test_ray_nodes.py."""

from __future__ import annotations

import pytest

from pdserve.deploy import ray_join
from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.deploy.placement import (
    check_custom_resources,
    check_labels,
    node_matches,
    pg_options,
)
from pdserve.deploy.prechecks import DeployError


def pool(**kwargs):
    return validate_config({"pools": {"decode": kwargs}}, "d.yaml").pools.decode


def refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        validate_config(data, "d.yaml")
    return str(e.value)


# ---- the YAML --------------------------------------------------------------------------------------
def test_custom_resources_join_the_bundle():
    p = pool(resources={"num_cpus": 2, "node2": 1, "memory_node": 0.5}, tp=2)
    assert p.resources.custom() == {"node2": 1, "memory_node": 0.5}
    assert pg_options(p) == {
        "bundles": [{"CPU": 2, "node2": 1.0, "memory_node": 0.5}] * 2,
        "strategy": "STRICT_PACK",
    }


@pytest.mark.parametrize(
    "resources, says",
    [
        ({"num_cpu": 1}, "pools.decode.resources: num_cpu: unknown key (num_cpus and num_gpus"),
        ({"CPU": 1}, "pools.decode.resources: CPU: use num_cpus for CPUs"),
        ({"node2": 0}, "pools.decode.resources: node2: a custom Ray resource's amount must be "),
        ({"node2": -1}, "node2: a custom Ray resource's amount must be positive (got -1)"),
        ({"node2": "1"}, "node2: a custom Ray resource's amount must be a number (got '1')"),
        ({"node2": True}, "node2: a custom Ray resource's amount must be a number (got True)"),
        ({"node2": 1e-5}, "node2: Ray counts resources in steps of 0.0001"),
        ({" node2": 1}, "' node2': a custom Ray resource needs a name without surrounding spaces"),
        ({"gpus": 1}, "pools.decode.resources: gpus: unknown key (num_cpus and num_gpus are"),
    ],
)
def test_bad_custom_resources_are_refused_naming_the_key(resources, says):
    assert says in refusal({"pools": {"decode": {"resources": resources}}})


def test_a_label_selector_goes_on_every_bundle_and_bad_ones_are_refused():
    p = pool(label_selector={"zone": "in(a,b)", "disk": "!hdd"}, tp=2)
    assert pg_options(p)["bundle_label_selector"] == [{"zone": "in(a,b)", "disk": "!hdd"}] * 2
    assert "bundle_label_selector" not in pg_options(pool())
    says = refusal({"pools": {"decode": {"label_selector": {"zone": "not a value!"}}}})
    assert says.startswith("d.yaml: pools.decode.label_selector: Invalid label selector value")
    says = refusal({"pools": {"decode": {"label_selector": {"zone": 3}}}})
    assert says.startswith("d.yaml: pools.decode.label_selector.zone: Input should be a valid str")


def test_the_dashboard_is_off_unless_asked_and_only_for_a_local_ray():
    assert validate_config({}).ray.dashboard is False
    on = validate_config({"ray": {"dashboard": True, "dashboard_port": 8266}}).ray
    assert (on.dashboard, on.dashboard_port) == (True, 8266)
    assert "ray: dashboard: only for the local Ray pdserve starts" in refusal(
        {"ray": {"dashboard": True, "address": "10.0.0.1:6379"}}
    )
    assert "ray: dashboard_port: set dashboard: true too" in refusal(
        {"ray": {"dashboard_port": 8266}}
    )
    assert "ray.dashboard: Input should be a valid boolean" in refusal({"ray": {"dashboard": "on"}})


def test_custom_resources_the_cluster_lacks_are_refused_naming_the_pool():
    both = validate_config(
        {
            "pools": {
                "decode": {"replicas": 2, "resources": {"num_cpus": 1, "big": 1}},
                "prefill": {"resources": {"num_cpus": 1, "big": 0.5}},
            }
        }
    )
    check_custom_resources(both, {"CPU": 4, "big": 2.5}, local=False)
    with pytest.raises(DeployError) as e:
        check_custom_resources(both, {"CPU": 4, "big": 2}, local=False)
    assert str(e.value) == (
        "pools.decode.resources.big: the pools ask for 2.5 big but the Ray cluster has 2; add "
        "nodes with `ray start --address ... --resources '{\"big\": N}'`, or change "
        "pools.decode.resources"
    )
    with pytest.raises(DeployError, match="a local Ray has no custom resources: join a cluster"):
        check_custom_resources(both, {"CPU": 4}, local=True)


# ---- labels against the nodes ----------------------------------------------------------------------
NODES = [
    {"Alive": True, "Labels": {"ray.io/node-id": "a1", "zone": "a", "disk": "ssd"}},
    {"Alive": True, "Labels": {"ray.io/node-id": "b2", "zone": "b"}},
    {"Alive": False, "Labels": {"zone": "c"}},
]


def test_label_selectors_match_as_rays_do():
    labels = NODES[0]["Labels"]
    assert node_matches(labels, {"zone": "a"}) and not node_matches(labels, {"zone": "b"})
    assert node_matches(labels, {"zone": "!b"}) and not node_matches(labels, {"zone": "!a"})
    assert node_matches(labels, {"zone": "in(b, a)"}) and node_matches(labels, {"zone": "!in(b,c)"})
    assert node_matches(labels, {"disk": ""}) and not node_matches(NODES[1]["Labels"], {"disk": ""})
    assert node_matches(labels, {"zone": "a", "disk": "ssd"})
    assert not node_matches(labels, {"zone": "a", "disk": "hdd"})


def test_a_selector_no_live_node_matches_is_refused_at_once():
    ok = validate_config({"pools": {"decode": {"label_selector": {"zone": "b"}}}})
    check_labels(ok, NODES)
    dead_only = validate_config({"pools": {"prefill": {"label_selector": {"zone": "c"}}}})
    with pytest.raises(DeployError) as e:
        check_labels(dead_only, NODES)
    assert str(e.value) == (
        "pools.prefill.label_selector: no live Ray node has labels matching zone=c (the nodes "
        "have: disk=ssd, zone=a; zone=b); start one with `ray start --labels KEY=VALUE`, or "
        "change pools.prefill.label_selector"
    )


# ---- the cluster's token ---------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_token_is_found_where_rays_clients_look_for_it(home, tmp_path):
    assert ray_join.find_token({}) == (None, "")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("from-home\n")
    assert ray_join.find_token({}) == ("from-home", str(home / ".ray" / "auth_token"))
    path = tmp_path / "tok"
    path.write_text(" from-path ")
    env = {"RAY_AUTH_TOKEN_PATH": str(path)}
    assert ray_join.find_token(env) == ("from-path", f"RAY_AUTH_TOKEN_PATH ({path})")
    assert ray_join.find_token({**env, "RAY_AUTH_TOKEN": "from-env"}) == (
        "from-env",
        "RAY_AUTH_TOKEN",
    )
    with pytest.raises(DeployError, match=r"^RAY_AUTH_TOKEN_PATH: cannot read .*missing"):
        ray_join.find_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})
    path.write_text("")
    with pytest.raises(DeployError, match=r"^RAY_AUTH_TOKEN_PATH: .* is empty"):
        ray_join.find_token(env)


class FakeGCS:
    """The GCS's answers to ray_join.probe: `wants` None (no auth) or the token it takes."""

    def __init__(self, wants: str | None, reachable: bool = True):
        self.wants, self.reachable, self.calls = wants, reachable, []

    def __call__(self, address, token, timeout_s=5.0):
        self.calls.append(token)
        if not self.reachable:
            return "unreachable: unavailable, Connection refused"
        return "ok" if self.wants is None or token == self.wants else "refused"


@pytest.fixture
def gcs(monkeypatch, home):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    enabled = []
    monkeypatch.setattr(ray_join, "enable_token_mode", lambda: enabled.append(True))

    def install(fake):
        monkeypatch.setattr(ray_join, "probe", fake)
        return enabled

    return install


def test_a_cluster_without_token_auth_is_joined_as_is(gcs):
    enabled = gcs(FakeGCS(None))
    assert "no token" in ray_join.prepare_join("10.0.0.1:6379", {})
    assert enabled == []


def test_the_found_token_turns_on_token_mode_when_the_cluster_takes_it(gcs, tmp_path):
    fake = FakeGCS("secret")
    enabled = gcs(fake)
    (tmp_path / "t").write_text("secret")
    note = ray_join.prepare_join("10.0.0.1:6379", {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "t")})
    assert note == f"token authentication, the token from RAY_AUTH_TOKEN_PATH ({tmp_path / 't'})"
    assert fake.calls == [None, "secret"] and enabled == [True]
    # RAY_AUTH_MODE=token set already: nothing to turn on
    enabled.clear()
    ray_join.prepare_join("10.0.0.1:6379", {"RAY_AUTH_TOKEN": "secret", "RAY_AUTH_MODE": "token"})
    assert enabled == []


@pytest.mark.parametrize(
    "environ, says",
    [
        (
            {},
            "the Ray cluster at 10.0.0.1:6379 (ray.address, --address) requires token "
            "authentication and no token was found: put the head's token (`ray get-auth-token` "
            "on the head node prints it) in ~/.ray/auth_token, or set RAY_AUTH_TOKEN to it, or "
            "RAY_AUTH_TOKEN_PATH to a file holding it",
        ),
        (
            {"RAY_AUTH_TOKEN": "stale"},
            "the Ray cluster at 10.0.0.1:6379 (ray.address, --address) refuses the token from "
            "RAY_AUTH_TOKEN (not the cluster's): put the head's token",
        ),
        (
            {"RAY_AUTH_TOKEN": "secret", "RAY_AUTH_MODE": "disabled"},
            "the Ray cluster at 10.0.0.1:6379 (ray.address, --address) requires token "
            "authentication, but RAY_AUTH_MODE=disabled: set RAY_AUTH_MODE=token",
        ),
    ],
)
def test_a_token_that_cannot_be_given_fails_in_one_line_saying_what_to_set(gcs, environ, says):
    enabled = gcs(FakeGCS("secret"))
    with pytest.raises(DeployError) as e:
        ray_join.prepare_join("10.0.0.1:6379", environ)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    assert enabled == []


def test_an_unreachable_cluster_is_named_with_its_port(gcs):
    gcs(FakeGCS(None, reachable=False))
    with pytest.raises(DeployError) as e:
        ray_join.prepare_join("10.0.0.1:6390", {})
    assert str(e.value) == (
        "cannot reach the Ray cluster at 10.0.0.1:6390 (ray.address, --address): unavailable, "
        "Connection refused; is `ray start --head` running there, and is 6390 its --port (the "
        "GCS port, default 6379)?"
    )


@pytest.mark.parametrize("address", ["auto", "ray://10.0.0.1:10001", "cluster-head"])
def test_addresses_ray_resolves_itself_are_left_to_ray(gcs, address):
    fake = FakeGCS("secret")
    gcs(fake)
    assert ray_join.prepare_join(address, {}) == "as Ray decides (not a host:port address)"
    assert fake.calls == []

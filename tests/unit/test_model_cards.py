"""GET /v1/models cards as vLLM's ModelCard (router/openai/models.py model_card): `root` is the
model's path or Hub repo id (an adapter's: its path) where the router's card gives one, else the
id; `permission` is a list of one ModelPermission with vLLM's defaults; the openai SDK's Model
still parses every card. On the front's ASGI app with a fake router."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from helpers.http_front import asgi_call, front_app
from helpers.sdk import LazyModule
from pdserve.protos.pdserve.v1 import pdserve_pb2

openai_types = LazyModule("openai.types")

# the router's cards: the base model (its Hub repo id) and an adapter (its path); the plain
# proto card has no root
BASE = SimpleNamespace(id="tiny", root="org/tiny-model", parent="", max_model_len=256)
ADAPTER = SimpleNamespace(id="sql", root="/adapters/sql", parent="tiny", max_model_len=256)
PERMISSION = {
    "object": "model_permission",
    "allow_create_engine": False,
    "allow_sampling": True,
    "allow_logprobs": True,
    "allow_search_indices": False,
    "allow_view": True,
    "allow_fine_tuning": False,
    "organization": "*",
    "group": None,
    "is_blocking": False,
}


class _Stub:
    def __init__(self, cards):
        self.cards = cards

    async def ListModels(self, request, metadata=(), timeout=None):
        return SimpleNamespace(models=self.cards)


def _get(cards, path: str):
    status, _, body = asyncio.run(asgi_call(front_app(stub=_Stub(cards)), "GET", path))
    assert status == 200, body
    return body


def test_root_is_the_models_path_or_repo_id_and_an_adapters_path():
    listed = _get([BASE, ADAPTER], "/v1/models")["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in listed] == [
        ("tiny", "org/tiny-model", None),
        ("sql", "/adapters/sql", "tiny"),
    ]
    assert _get([BASE, ADAPTER], "/v1/models/sql")["root"] == "/adapters/sql"
    # a router card with no root: the id, as before
    plain = pdserve_pb2.ModelCard(id="tiny", max_model_len=256)
    assert _get([plain], "/v1/models/tiny")["root"] == "tiny"


def test_permission_is_vllms_list_and_the_sdk_parses_the_cards():
    listed = _get([BASE, ADAPTER], "/v1/models")
    for card in listed["data"]:
        (permission,) = card["permission"]
        assert permission["id"].startswith("modelperm-")
        assert permission["created"] == card["created"]
        assert {k: permission[k] for k in PERMISSION} == PERMISSION
        model = openai_types.Model.model_validate(card)
        assert model.id == card["id"] and model.owned_by == "pdserve"
    page = openai_types.Model.model_validate(_get([BASE], "/v1/models/tiny"))
    assert page.root == "org/tiny-model" and len(page.permission) == 1

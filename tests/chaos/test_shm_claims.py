"""A sender on the shm backend that claimed a reservation, copied two layers into the decode
worker's pool and went silent (a prefill worker stopped mid-step, as far as the decode side can
tell): the aborted reservation stays held, never handed to another request, past the claim's
bound with the worker reporting itself unhealthy; once the sender's process ends the blocks are
freed and the worker is healthy again (helpers/chaos.py `silent_sender_held`, also run on the
nixl backend by test_nixl_chaos.py)."""

from __future__ import annotations

from helpers.chaos import silent_sender_held


def test_a_silent_shm_sender_keeps_its_reservation_held_until_its_process_ends(tiny_models):
    silent_sender_held(tiny_models, "shm", remote=False)

"""The tenancy flags beside the stored responses and the dashboard (test_tenancy.py): with API keys each
key's cached prefixes are its own, so no key hits (or times) another's prompt, unless
--shared-prefix-cache; --priority-range is parsed strictly and refuses a bad value before the model
loads."""

from __future__ import annotations

import pytest
from app_server import AppServer, serve_args, server_settings

from deepinfer.serving.admission import INT64_MAX, INT64_MIN, PriorityRange
from deepinfer.serving.tenancy import EVERYONE, Tenant

KEY_A, KEY_B = "tenant-key-a-1111", "tenant-key-b-2222"
IDS = [(7 * i) % 500 + 5 for i in range(40)]  # 40 token ids: 2 full blocks of 16 can hit


def _cached(server: AppServer, key: str, salt: str | None = None) -> int:
    body = {"prompt": IDS, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    resp = server.client.post("/v1/completions", json=body | ({"cache_salt": salt} if salt else {}),
                              headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("shared", [False, True])
def test_a_key_hits_only_its_own_cached_prefixes_unless_shared(tiny_checkpoint, shared):
    flags = ["--model", tiny_checkpoint("llama"), "--num-blocks", "64", "--api-key", KEY_A, "--api-key", KEY_B]
    with AppServer(*flags, *(["--shared-prefix-cache"] if shared else [])) as server:
        assert _cached(server, KEY_A) == 0
        assert _cached(server, KEY_A) == 32  # a key hits its own prefix
        assert _cached(server, KEY_B) == (32 if shared else 0)  # another key's: only when shared
        assert _cached(server, KEY_B, salt="s") == 0  # a salt still keeps requests apart within a key
        assert _cached(server, KEY_B, salt="s") == 32


@pytest.mark.parametrize("text, low, high", [("0:", 0, INT64_MAX), ("-5:5", -5, 5), (":3", INT64_MIN, 3),
                                             (" -1 : 1 ", -1, 1), (":", INT64_MIN, INT64_MAX)])
def test_a_priority_range_is_min_colon_max(text, low, high):
    assert PriorityRange.parse(text) == PriorityRange(low, high)


@pytest.mark.parametrize("text", ["5", "a:b", "5:1", "1.5:2", "1:2:3", "9" * 30 + ":", ":-" + "9" * 30])
def test_a_bad_priority_range_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match="--priority-range"):
        server_settings(serve_args([f"--priority-range={text}"]))


def test_the_range_binds_clients_but_not_the_operator():
    bounds = PriorityRange.parse("-5:5")
    bounds.check(5, EVERYONE)
    bounds.check(-1000, Tenant("key:ops", admin=True))
    with pytest.raises(Exception, match="outside the range"):
        bounds.check(6, Tenant("key:client"))

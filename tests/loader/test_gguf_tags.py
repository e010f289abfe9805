"""Quant tags (`gguf_tags.py`): which file or split set `org/name:TAG` names in a GGUF repository."""

import pytest

from deepinfer.model_executor.loader.gguf_tags import file_tags, has_tag, pick_gguf, split_tag

REPO = [
    "README.md", "Qwen2.5-7B-Instruct-IQ4_XS.gguf", "Qwen2.5-7B-Instruct-Q4_K.gguf",
    "Qwen2.5-7B-Instruct-Q4_K_M.gguf", "Qwen2.5-7B-Instruct-Q3_K_M.gguf", "mmproj-Qwen2.5-7B-F16.gguf",
    "Q8_0/Qwen2.5-7B-Instruct-Q8_0-00002-of-00002.gguf", "Q8_0/Qwen2.5-7B-Instruct-Q8_0-00001-of-00002.gguf",
    "Qwen2.5-7B-Instruct-UD-Q2_K_XL.gguf",
]


@pytest.mark.parametrize("name,parsed", [
    ("org/repo:Q4_K_M", ("org/repo", "Q4_K_M")), ("org/repo:ud-q2_k_xl", ("org/repo", "ud-q2_k_xl")),
    ("org/repo:file.gguf", ("org/repo:file.gguf", None)), ("org/repo", ("org/repo", None)),
    ("org/repo:a/b", ("org/repo:a/b", None)), ("org/repo:", ("org/repo:", None)),
])
def test_split_tag(name, parsed):
    assert split_tag(name) == parsed


def test_a_hostile_tag_is_no_tag_and_matches_literally():
    assert split_tag("org/repo:" + "Q" * 65) == ("org/repo:" + "Q" * 65, None)  # bounded: not a tag
    assert split_tag("org/repo:../x")[1] is None and split_tag("org/repo:.*")[1] is None
    assert not has_tag("m-Q4_K_M.gguf", "Q4.K.M")  # regex characters are literal


def test_a_tag_matches_whole_tokens_only():
    assert has_tag("m-Q4_K_M.gguf", "q4_k_m") and has_tag("Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", "Q4_K_M")
    assert not has_tag("m-Q4_K_M.gguf", "Q4_K") and not has_tag("m-IQ4_XS.gguf", "Q4_XS")


def test_tags_pick_one_file_a_whole_split_set_in_order_and_never_a_projector():
    assert pick_gguf("o/r", REPO, "iq4_xs") == ["Qwen2.5-7B-Instruct-IQ4_XS.gguf"]
    assert pick_gguf("o/r", REPO, "Q4_K") == ["Qwen2.5-7B-Instruct-Q4_K.gguf"]
    assert pick_gguf("o/r", REPO, "Q8_0") == ["Q8_0/Qwen2.5-7B-Instruct-Q8_0-00001-of-00002.gguf",
                                             "Q8_0/Qwen2.5-7B-Instruct-Q8_0-00002-of-00002.gguf"]
    assert pick_gguf("o/r", REPO, "UD-Q2_K_XL") == ["Qwen2.5-7B-Instruct-UD-Q2_K_XL.gguf"]
    assert pick_gguf("o/r", REPO, None) == ["Qwen2.5-7B-Instruct-Q4_K_M.gguf"]  # the default
    assert pick_gguf("o/r", ["a.gguf", "mmproj-a.gguf"], None) == ["a.gguf"]  # the only model
    assert file_tags(REPO) == ["IQ4_XS", "Q3_K_M", "Q4_K", "Q4_K_M", "Q8_0", "UD-Q2_K_XL"]


def test_refusals_name_the_tags_there_are():
    with pytest.raises(ValueError, match=r"no GGUF file with quant tag 'Q5_K_M' \(tags: IQ4_XS, Q3_K_M"):
        pick_gguf("o/r", REPO, "Q5_K_M")
    with pytest.raises(ValueError, match=r"holds 2 GGUF models and none is Q4_K_M: name one as o/r:TAG "
                                         r"\(tags: Q4_0, Q8_0\)"):
        pick_gguf("o/r", ["a-Q8_0.gguf", "a-Q4_0.gguf"], None)
    with pytest.raises(ValueError, match=r"quant tag 'Q8_0' matches 2 files \(a-Q8_0.gguf, b-Q8_0.gguf\)"):
        pick_gguf("o/r", ["a-Q8_0.gguf", "b-Q8_0.gguf"], "Q8_0")
    with pytest.raises(ValueError, match=r"the split set 'm-Q8_0-00001-of-00003.gguf' has 3 parts, the repository 2 "
                                         r"\(missing part\(s\) 2\)"):
        pick_gguf("o/r", ["m-Q8_0-00001-of-00003.gguf", "m-Q8_0-00003-of-00003.gguf"], "Q8_0")
    with pytest.raises(ValueError, match="has no GGUF files"):
        pick_gguf("o/r", ["README.md", "mmproj-x.gguf"], None)

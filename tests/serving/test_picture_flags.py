"""The picture flags of `deepinfer serve`: parsed into the server's media policy, bad values refused
naming the flag before the model loads."""

from __future__ import annotations

import argparse

import pytest

from deepinfer.entrypoints.openai.args import add_media_args, media_settings
from deepinfer.serving.context import ServerSettings
from deepinfer.serving.pictures import MAX_PICTURE_PIXELS, MAX_PICTURES_PER_REQUEST


def parse(*flags: str):
    parser = argparse.ArgumentParser()
    add_media_args(parser)
    return parser.parse_args(list(flags))


def test_defaults_refuse_files_and_urls():
    policy = ServerSettings("m", **media_settings(parse())).media_policy()
    assert policy.allowed_media_dir is None and not policy.allow_remote_media and not policy.allow_any_path
    assert policy.max_picture_pixels == MAX_PICTURE_PIXELS == 4096 * 4096
    assert policy.max_pictures_per_request == MAX_PICTURES_PER_REQUEST == 8


def test_flags_reach_the_policy(tmp_path):
    args = parse("--allowed-media-dir", str(tmp_path), "--allow-remote-media", "--max-picture-pixels", "1000",
                 "--max-pictures-per-request", "3")
    policy = ServerSettings("m", **media_settings(args)).media_policy()
    assert (policy.allowed_media_dir, policy.allow_remote_media, policy.max_picture_pixels,
            policy.max_pictures_per_request) == (str(tmp_path), True, 1000, 3)


@pytest.mark.parametrize("flags,named", [(("--max-picture-pixels", "0"), "--max-picture-pixels"),
                                         (("--max-pictures-per-request", "-1"), "--max-pictures-per-request"),
                                         (("--allowed-media-dir", "/no/such/dir"), "--allowed-media-dir")])
def test_bad_values_name_the_flag(flags, named):
    with pytest.raises(ValueError, match=named):
        media_settings(parse(*flags))

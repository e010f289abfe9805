"""Picture loading: every bad input is a FieldError naming its part and why; good ones decode to RGB."""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib

import pytest
from PIL import Image

from deepinfer.serving.pictures import (
    OFFLINE,
    MediaPolicy,
    PictureError,
    PictureRef,
    content_hash,
    load_picture,
    load_pictures,
    picture_parts,
)

WHERE = ("messages", 1, "content", 2)


def png_bytes(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims width x height pixels, in a few dozen bytes (its data is one empty chunk)."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


DEFAULT = MediaPolicy()


def refused(ref: PictureRef, policy: MediaPolicy = DEFAULT) -> str:
    with pytest.raises(PictureError) as info:
        load_picture(ref, policy)
    assert info.value.path == ref.path
    return str(info.value)


def test_a_data_url_decodes_to_rgb_with_a_hash_of_its_pixels():
    image = Image.new("RGB", (7, 5), (1, 2, 3))
    picture = load_picture(PictureRef(WHERE, data_url(png_bytes(image))), MediaPolicy())
    assert picture.image.mode == "RGB" and picture.image.size == (7, 5)
    assert picture.content_hash == content_hash(image)
    other = load_picture(PictureRef(WHERE, data_url(png_bytes(Image.new("RGB", (7, 5), (1, 2, 4))))), MediaPolicy())
    assert other.content_hash != picture.content_hash
    same_as_jpeg_source = load_picture(PictureRef(WHERE, base64.b64encode(png_bytes(image)).decode(), base64=True),
                                       MediaPolicy())
    assert same_as_jpeg_source.content_hash == picture.content_hash  # raw base64 (Ollama): the same picture


def test_palette_grey_alpha_and_animated_pictures_become_rgb():
    palette = Image.new("P", (4, 4))
    palette.putpalette([255, 0, 0] * 256)
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # transparent: composed onto white
    frames = [Image.new("RGB", (4, 4), (9, 9, 9)), Image.new("RGB", (4, 4), (200, 200, 200))]
    animated = png_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:])
    for data in (png_bytes(palette), png_bytes(Image.new("L", (4, 4), 7)), png_bytes(rgba), animated):
        picture = load_picture(PictureRef(WHERE, data_url(data)), MediaPolicy())
        assert picture.image.mode == "RGB"
    assert load_picture(PictureRef(WHERE, data_url(png_bytes(palette))), MediaPolicy()).image.getpixel((0, 0)) == (
        255, 0, 0)
    assert load_picture(PictureRef(WHERE, data_url(png_bytes(rgba))), MediaPolicy()).image.getpixel((0, 0)) == (
        255, 255, 255)


def test_not_a_picture_truncated_base64_and_a_cut_file_are_refused_naming_the_part():
    assert "not a picture" in refused(PictureRef(WHERE, data_url(b"hello, this is text")))
    assert "not valid base64" in refused(PictureRef(WHERE, "data:image/png;base64,iVBORw0KGgo="[:-3]))
    assert "not valid base64" in refused(PictureRef(WHERE, "abc$%", base64=True))
    cut = png_bytes(Image.new("RGB", (64, 64), (5, 6, 7)))[:60]
    assert "cannot be decoded" in refused(PictureRef(WHERE, data_url(cut)))
    assert "base64 encoded" in refused(PictureRef(WHERE, "data:image/png,rawbytes"))
    assert str(refused(PictureRef(WHERE, data_url(b"xx")))).startswith("messages[1].content[2]: ")


def test_a_bomb_header_is_refused_before_its_pixels_are_decoded():
    bomb = bomb_png()
    assert len(bomb) < 100
    message = refused(PictureRef(WHERE, data_url(bomb)))
    assert "pixels" in message and "--max-picture-pixels" in message  # PIL's own guard (Image.open) or ours
    message = refused(PictureRef(WHERE, data_url(bomb_png(5000, 5000))))  # under PIL's guard: ours
    assert "5000x5000" in message and "--max-picture-pixels" in message
    small_limit = MediaPolicy(max_picture_pixels=10 * 10)
    assert "11x10" in refused(PictureRef(WHERE, data_url(png_bytes(Image.new("RGB", (11, 10))))), small_limit)
    assert "over 50 bytes" in refused(PictureRef(WHERE, data_url(png_bytes(Image.new("RGB", (64, 64), 3)))),
                                      MediaPolicy(max_picture_bytes=50))


def test_too_many_pictures_names_the_first_one_over_the_limit():
    url = data_url(png_bytes(Image.new("RGB", (2, 2))))
    refs = [PictureRef(("messages", 0, "content", j), url) for j in range(3)]
    with pytest.raises(PictureError) as info:
        load_pictures(refs, MediaPolicy(max_pictures_per_request=2))
    assert info.value.path == ("messages", 0, "content", 2)
    assert "at most 2 pictures" in str(info.value) and "--max-pictures-per-request" in str(info.value)
    assert len(load_pictures(refs[:2], MediaPolicy(max_pictures_per_request=2))) == 2


def test_local_files_only_below_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    data = png_bytes(Image.new("RGB", (3, 3), (4, 5, 6)))
    (allowed / "ok.png").write_bytes(data)
    (outside / "secret.png").write_bytes(data)
    os.symlink(outside / "secret.png", allowed / "link.png")
    policy = MediaPolicy(allowed_media_dir=str(allowed))
    assert load_picture(PictureRef(WHERE, f"file://{allowed}/ok.png"), policy).image.size == (3, 3)
    assert "--allowed-media-dir" in refused(PictureRef(WHERE, f"file://{allowed}/ok.png"))  # no directory: refused
    assert "outside" in refused(PictureRef(WHERE, f"file://{outside}/secret.png"), policy)
    assert "outside" in refused(PictureRef(WHERE, f"file://{allowed}/../private/secret.png"), policy)
    assert "outside" in refused(PictureRef(WHERE, f"file://{allowed}/link.png"), policy)  # a symlink out
    assert "cannot read" in refused(PictureRef(WHERE, f"file://{allowed}/missing.png"), policy)
    assert "must be a data URL" in refused(PictureRef(WHERE, str(allowed / "ok.png")), policy)  # a bare path
    assert load_picture(PictureRef(WHERE, str(outside / "secret.png")), OFFLINE).image.size == (3, 3)  # offline


def test_http_urls_need_the_flag():
    message = refused(PictureRef(WHERE, "http://169.254.169.254/latest/meta-data/x.png"))
    assert "--allow-remote-media" in message


def test_http_urls_with_the_flag_follow_no_redirect(monkeypatch):
    import httpx

    data = png_bytes(Image.new("RGB", (2, 3)))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/moved.png":
            return httpx.Response(302, headers={"Location": "file:///etc/passwd"})
        return httpx.Response(200, content=data)

    real_stream = httpx.stream

    def stream(method, url, **kwargs):
        client = httpx.Client(transport=httpx.MockTransport(handler))
        kwargs.pop("timeout", None)
        return client.stream(method, url, **kwargs)

    monkeypatch.setattr(httpx, "stream", stream)
    policy = MediaPolicy(allow_remote_media=True)
    assert load_picture(PictureRef(WHERE, "https://pictures.test/a.png"), policy).image.size == (2, 3)
    assert "redirects are not followed" in refused(PictureRef(WHERE, "https://pictures.test/moved.png"), policy)
    assert "over 20 bytes" in refused(PictureRef(WHERE, "https://pictures.test/a.png"),
                                      MediaPolicy(allow_remote_media=True, max_picture_bytes=20))
    assert real_stream is not stream


def test_picture_parts_become_template_image_parts_in_order():
    image = Image.new("RGB", (2, 2))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
                                             {"type": "image", "image": image}]}]
    converted, refs = picture_parts(messages)
    assert converted[0] is messages[0]
    assert converted[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]
    assert [r.path for r in refs] == [("messages", 1, "content", 1), ("messages", 1, "content", 2)]
    assert refs[0].source == "data:x" and refs[1].source is image
    with pytest.raises(PictureError) as info:
        picture_parts([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert info.value.path == ("messages", 0, "content", 0)

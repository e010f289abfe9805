"""Pictures of a request: where they come from, how far they are trusted, and their decoding.

    source (what the API sent)                        allowed
    data:image/png;base64,...   (OpenAI, the page)     always
    raw base64 (+ media type)   (Ollama, Anthropic)    always
    file:///dir/a.png, a path                          under --allowed-media-dir only (offline: any path)
    http(s)://host/a.png                               with --allow-remote-media only (a server fetching
                                                       URLs its clients name can reach its own network)
    a PIL image                                        `LLM.chat` only

Every picture is checked before its pixels are decoded: its encoded bytes against
`max_picture_bytes`, the header's width * height against `max_picture_pixels` (a decompression bomb:
a few hundred bytes of PNG that claim 100000 x 100000 pixels), and the request's count against
`max_pictures_per_request`. Then it is decoded to RGB (a palette, grey, alpha or CMYK picture is
converted; an animated one gives its first frame). Every refusal is a `FieldError` naming the part
in the client's own names (`messages[1].content[0]`, `messages[0].images[2]`, `input[0].content[1]`)
and why. The content hash (blake2b of mode, size and pixels) is the picture's identity for the
prefix cache and the encoder-output cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from PIL import Image

from deepinfer.serving.errors import FieldError, Path

MAX_PICTURE_PIXELS = 4096 * 4096  # as large as any vision encoder here reads well; a bigger one is refused
MAX_PICTURES_PER_REQUEST = 8
MAX_PICTURE_BYTES = 20 << 20  # encoded bytes of one picture (as OpenAI's 20 MB)
REMOTE_TIMEOUT_S = 10.0
_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # what a picture may be encoded as


class PictureError(FieldError):
    """A refused picture; its path is already in the client's own names (`messages[0].images[1]`)."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where pictures may come from and how large they may be (the serve flags)."""

    allowed_media_dir: str | None = None  # file:// sources are read only below it (None: refused)
    allow_remote_media: bool = False  # http(s) sources are fetched (SSRF: off by default)
    max_picture_pixels: int = MAX_PICTURE_PIXELS
    max_pictures_per_request: int = MAX_PICTURES_PER_REQUEST
    max_picture_bytes: int = MAX_PICTURE_BYTES
    allow_any_path: bool = False  # offline (`LLM.chat`): a local path is the caller's own file

    def __post_init__(self):
        for name in ("max_picture_pixels", "max_pictures_per_request", "max_picture_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


OFFLINE = MediaPolicy(allow_any_path=True)


@dataclass(frozen=True)
class PictureRef:
    """One picture part of a request, not yet loaded: `source` is a URL or path string, base64 text
    (`media_type` set, or an Ollama image), or a PIL image; `path` is where it sits in the body."""

    path: Path
    source: Any
    base64: bool = False  # source is bare base64 text


@dataclass(frozen=True)
class Picture:
    """A decoded picture: RGB pixels and their content hash."""

    image: Image.Image
    content_hash: str


def check_count(refs: list[PictureRef], policy: MediaPolicy) -> None:
    """FieldError at the first picture over the request's limit."""
    if len(refs) > policy.max_pictures_per_request:
        raise PictureError(refs[policy.max_pictures_per_request].path,
                         f"a request may carry at most {policy.max_pictures_per_request} pictures "
                         f"(--max-pictures-per-request), this one has {len(refs)}")


def load_pictures(refs: list[PictureRef], policy: MediaPolicy) -> list[Picture]:
    """Every picture decoded, in order; FieldError naming the first bad one."""
    check_count(refs, policy)
    return [load_picture(ref, policy) for ref in refs]


def load_picture(ref: PictureRef, policy: MediaPolicy) -> Picture:
    """One picture decoded to RGB and hashed; FieldError naming its part for anything refused."""
    if isinstance(ref.source, Image.Image):
        _check_pixels(ref.source.size, ref.path, policy)
        return _picture(ref.source)
    data = encoded_bytes(ref, policy)
    return decode(data, ref.path, policy)


def encoded_bytes(ref: PictureRef, policy: MediaPolicy) -> bytes:
    """The picture's encoded bytes from wherever its source says."""
    source = ref.source
    if not isinstance(source, str) or not source:
        raise PictureError(ref.path, f"must be a data URL, a URL or base64 text, got {type(source).__name__}")
    if ref.base64:
        return _b64decode(source, ref.path, policy)
    if source.startswith("data:"):
        head, sep, payload = source.partition(",")
        if not sep or not head.endswith(";base64"):
            raise PictureError(ref.path, "a data URL must be base64 encoded: data:image/png;base64,...")
        return _b64decode(payload, ref.path, policy)
    lowered = source[:8].lower()
    if lowered.startswith(("http://", "https://")):
        return _fetch(source, ref.path, policy)
    if lowered.startswith("file://") or policy.allow_any_path:
        return _read_file(source, ref.path, policy)
    raise PictureError(ref.path, "must be a data URL (data:image/png;base64,...), an http(s) URL or a file:// URL")


def _b64decode(text: str, path: Path, policy: MediaPolicy) -> bytes:
    if len(text) > (policy.max_picture_bytes * 4) // 3 + 4:
        raise PictureError(path, f"the picture is over {policy.max_picture_bytes} bytes")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise PictureError(path, "is not valid base64 (truncated or holding other characters)") from None


def _read_file(source: str, path: Path, policy: MediaPolicy) -> bytes:
    """A local file: below --allowed-media-dir after every link and `..` is resolved (offline: anywhere)."""
    name = unquote(source[len("file://"):]) if source[:7].lower() == "file://" else source
    if not policy.allow_any_path:
        if policy.allowed_media_dir is None:
            raise PictureError(path, "file:// pictures are refused: the server reads local files only when "
                             "started with --allowed-media-dir DIR")
        root = os.path.realpath(policy.allowed_media_dir)
        real = os.path.realpath(name)
        if os.path.commonpath([root, real]) != root:
            raise PictureError(path, f"{name!r} is outside the allowed media directory (--allowed-media-dir)")
        name = real
    try:
        with open(name, "rb") as f:
            data = f.read(policy.max_picture_bytes + 1)
    except OSError as exc:
        raise PictureError(path, f"cannot read {name!r}: {exc.strerror or exc}") from None
    if len(data) > policy.max_picture_bytes:
        raise PictureError(path, f"the picture is over {policy.max_picture_bytes} bytes")
    return data


def _fetch(url: str, path: Path, policy: MediaPolicy) -> bytes:
    """An http(s) picture, only with --allow-remote-media: no redirects followed, size-capped, timed out."""
    if not policy.allow_remote_media:
        raise PictureError(path, "http(s) picture URLs are refused: a server that fetches URLs for its clients "
                         "can be made to reach its own network; start it with --allow-remote-media to allow "
                         "them, or send the picture as a data URL")
    import httpx

    try:
        with httpx.stream("GET", url, timeout=REMOTE_TIMEOUT_S, follow_redirects=False) as response:
            if response.status_code != 200:
                raise PictureError(path, f"fetching the picture answered HTTP {response.status_code}"
                                 + (" (redirects are not followed)" if response.is_redirect else ""))
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > policy.max_picture_bytes:
                    raise PictureError(path, f"the picture is over {policy.max_picture_bytes} bytes")
            return bytes(data)
    except httpx.HTTPError as exc:
        raise PictureError(path, f"fetching the picture failed: {type(exc).__name__}") from None


def decode(data: bytes, path: Path, policy: MediaPolicy) -> Picture:
    """Encoded bytes -> an RGB picture, its size checked from the header before any pixel is decoded."""
    if len(data) > policy.max_picture_bytes:
        raise PictureError(path, f"the picture is over {policy.max_picture_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=_FORMATS)  # lazy: reads the header only
        _check_pixels(image.size, path, policy)
        image.seek(0)  # an animated picture: its first frame
        image.load()
    except PictureError:
        raise
    except Image.DecompressionBombError:
        raise PictureError(path, f"the picture's header claims more pixels than the limit of "
                           f"{policy.max_picture_pixels} (--max-picture-pixels)") from None
    except Image.UnidentifiedImageError:
        raise PictureError(path, f"is not a picture in a supported format ({', '.join(_FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise PictureError(path, f"the picture cannot be decoded (truncated or corrupt: {exc})") from None
    return _picture(image)


def _check_pixels(size: tuple[int, int], path: Path, policy: MediaPolicy) -> None:
    width, height = size
    if width < 1 or height < 1 or width * height > policy.max_picture_pixels:
        raise PictureError(path, f"the picture is {width}x{height} pixels; the limit is {policy.max_picture_pixels} "
                         f"pixels (--max-picture-pixels)")


def _picture(image: Image.Image) -> Picture:
    rgb = to_rgb(image)
    return Picture(rgb, content_hash(rgb))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels: a palette or grey picture converted, transparency composed onto white."""
    if image.mode == "RGB":
        return image
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def content_hash(image: Image.Image) -> str:
    """blake2b (hex) of the picture's mode, size and pixel bytes."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def set_decoder_guard(max_picture_pixels: int) -> None:
    """PIL's own decompression-bomb limit at the server's: a header over twice the limit is refused
    inside Image.open; its warning (over the limit) is silenced, as `decode` refuses those itself."""
    Image.MAX_IMAGE_PIXELS = max_picture_pixels
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


PICTURE_TYPES = ("image_url", "image", "image_pil")  # a content part that is a picture


def picture_parts(messages: list[dict], paths: list[Path] | None = None) -> tuple[list[dict], list[PictureRef]]:
    """Chat messages with their picture parts as the HF chat format's `{"type": "image"}`, and the
    pictures in order. A part is OpenAI's `{"type": "image_url", "image_url": {"url"} | URL}`, or (offline)
    `{"type": "image", "image": PIL image | path | URL}` / `{"type": "image_pil", "image_pil": ...}`.
    `paths`: each picture's place in the client's own body (default `messages[i].content[j]`).
    A message without pictures keeps its text content as a string."""
    converted, refs = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_picture(p) for p in content):
            converted.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if not _is_picture(part):
                parts.append(part)
                continue
            where = paths[len(refs)] if paths is not None else ("messages", i, "content", j)
            refs.append(PictureRef(where, _part_source(part, where)))
            parts.append({"type": "image"})
        converted.append({**message, "content": parts})
    return converted, refs


def has_pictures(messages: list[dict]) -> bool:
    """Whether a message's content holds a picture part."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(_is_picture, m["content"]))
               for m in messages)


def _is_picture(part) -> bool:
    return isinstance(part, dict) and part.get("type") in PICTURE_TYPES


def _part_source(part: dict, where: Path):
    """The URL, path or PIL image a picture part names."""
    value = part.get(part["type"])
    if part["type"] == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if value is None and part["type"] == "image":
        value = part.get("url") or part.get("path")
    if isinstance(value, Image.Image) or (isinstance(value, str) and value):
        return value
    raise PictureError(where, f"a {part['type']} part needs its picture (a URL string), got "
                     f"{type(value).__name__}")


def take_picture_paths(messages: list[dict], default: Path = ("messages",)) -> list[Path] | None:
    """The paths a converter wrote into its picture parts (`"path"`, removed here), in order; a
    picture part without one gets `default`. None when there is no picture."""
    paths = []
    for message in messages:
        for part in message["content"] if isinstance(message.get("content"), list) else ():
            if _is_picture(part):
                paths.append(tuple(part.pop("path", default)))
    return paths or None

"""Synthetic "shapes" world with pixel-exact ground-truth masks.

Every scene is a 64x64 RGB image holding one, two or three objects drawn from
:data:`CLASSES`.  Classes differ by *shape only*: colour, size, rotation,
aspect jitter, texture and position are drawn at random inside every class.
Backgrounds are cluttered (two-colour gradients, pixel noise) and carry
distractor strokes, arcs, dots and elongated blobs that belong to no class
and use the same colour and texture distribution as objects.

Objects are painted last, flat (no noise), so ``masks`` are exactly the set
of pixels painted for each object; distractors are kept 2 px away from every
object so that object outlines stay unambiguous.  In scenes of several
objects (of distinct classes) the objects are placed with disjoint bounding discs and a gap of at least
:data:`MIN_GAP` pixels.

Everything is vectorised numpy (inside tests on a rotated coordinate grid),
deterministic for a seed (``numpy.random.Generator``) and renders thousands
of scenes per second on one core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "CLASSES",
    "IMAGE_SIZE",
    "PATCH_SIZE",
    "MEAN",
    "STD",
    "Scenes",
    "make_scenes",
    "render_object",
    "normalize",
]

IMAGE_SIZE = 64
PATCH_SIZE = 8
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)

CLASSES = (
    "circle",
    "square",
    "triangle",
    "plus",
    "ring",
    "star",
    "L-shape",
    "T-shape",
    "arrow",
    "crescent",
    "H-shape",
    "heart",
)

#: radius (in units of the object scale) of a disc containing every shape,
#: aspect jitter included
BOUND = 1.3 * 1.1
#: minimum gap in pixels between the bounding discs of two objects
MIN_GAP = 2.0
#: distractors stay this many pixels away from objects
HALO = 2

#: objects are rotated by a random angle in [-MAX_ROTATION, MAX_ROTATION]
#: (radians) from their upright pose
MAX_ROTATION = np.deg2rad(25.0)
SINGLE_SCALE = (9.0, 15.0)
PAIR_SCALE = (8.5, 12.0)
TRIPLE_SCALE = (7.0, 10.0)
#: joint redraws of both object positions before the corner fallback
PLACEMENT_ROUNDS = 256
N_DISTRACTOR_SLOTS = 7

_STAR_RI = 0.45
_STAR_B = (_STAR_RI * np.cos(np.pi / 5), _STAR_RI * np.sin(np.pi / 5))


# --------------------------------------------------------------------------
# shape inside tests, in normalised object coordinates (u right, v down)
# --------------------------------------------------------------------------
def _inside(k: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    au, av = np.abs(u), np.abs(v)
    if k == 0:  # circle
        return u * u + v * v <= 1.0
    if k == 1:  # square
        return np.maximum(au, av) <= 0.78
    if k == 2:  # triangle (circumradius 1)
        return (v <= 0.5) & (v >= -1.0 + np.sqrt(3.0) * au)
    if k == 3:  # plus
        return ((au <= 0.28) & (av <= 0.95)) | ((av <= 0.28) & (au <= 0.95))
    if k == 4:  # ring
        r2 = u * u + v * v
        return (r2 <= 1.0) & (r2 >= 0.55**2)
    if k == 5:  # five-pointed star
        r = np.sqrt(u * u + v * v)
        a = 2.0 * np.pi / 5.0
        phi = np.mod(np.arctan2(v, u), a)
        phi = np.minimum(phi, a - phi)
        px, py = r * np.cos(phi), r * np.sin(phi)
        bx, by = _STAR_B
        cross = (bx - 1.0) * py - by * (px - 1.0)
        return cross >= 0.0
    if k == 6:  # L
        bar1 = (u >= -0.85) & (u <= -0.35) & (av <= 0.9)
        bar2 = (u >= -0.85) & (u <= 0.75) & (v >= 0.4) & (v <= 0.9)
        return bar1 | bar2
    if k == 7:  # T
        bar = (au <= 0.9) & (v >= -0.9) & (v <= -0.45)
        stem = (au <= 0.24) & (av <= 0.9)
        return bar | stem
    if k == 8:  # arrow
        shaft = (u >= -0.95) & (u <= 0.15) & (av <= 0.22)
        head = (u >= 0.15) & (u <= 0.95) & (av <= 0.75 * (0.95 - u) / 0.8)
        return shaft | head
    if k == 9:  # crescent
        return (u * u + v * v <= 1.0) & ((u - 0.5) ** 2 + v * v > 0.75**2)
    if k == 10:  # H
        legs = (au >= 0.5) & (au <= 0.9) & (av <= 0.9)
        bar = (au <= 0.9) & (av <= 0.2)
        return legs | bar
    if k == 11:  # heart
        x = 1.2 * u
        y = 0.15 - 1.2 * v
        return (x * x + y * y - 1.0) ** 3 - x * x * y**3 <= 0.0
    raise ValueError(f"unknown class {k}")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def _grid(size: int):
    c = np.arange(size, dtype=np.float32) + 0.5
    return c[None, None, :], c[None, :, None]  # x (…,1,W), y (…,H,1)


def _hsv_to_rgb(h, s, v):
    h6 = (h % 1.0) * 6.0
    i = np.floor(h6).astype(np.int64) % 6
    f = h6 - np.floor(h6)
    p = v * (1 - s)
    q = v * (1 - s * f)
    t = v * (1 - s * (1 - f))
    r = np.choose(i, [v, q, p, p, t, v])
    g = np.choose(i, [t, v, v, q, p, p])
    b = np.choose(i, [p, p, t, v, v, q])
    return np.stack([r, g, b], -1) * 255.0


def _sample_colors(rng, shape, bg):
    """Saturated colours, best of four candidates for contrast to ``bg``."""
    cand = _hsv_to_rgb(
        rng.random(shape + (4,)),
        rng.uniform(0.45, 1.0, shape + (4,)),
        rng.uniform(0.45, 1.0, shape + (4,)),
    )  # shape + (4, 3)
    bgx = bg.reshape(bg.shape[:1] + (1,) * (len(shape) - 1) + (1, 3))
    d = np.linalg.norm(cand - bgx, axis=-1)
    best = np.argmax(d, axis=-1)
    return np.take_along_axis(cand, best[..., None, None], axis=-2)[..., 0, :]


def _variant(rng, color):
    """Second colour of a texture: darker or lighter version of ``color``."""
    dark = rng.random(color.shape[:-1]) < 0.5
    f = rng.uniform(0.35, 0.65, color.shape[:-1])[..., None]
    return np.where(dark[..., None], color * (1 - f), color + (255.0 - color) * f)


def _sample_textures(rng, shape):
    return dict(
        tex=rng.integers(0, 4, shape),
        tex_angle=rng.uniform(0, np.pi, shape),
        tex_period=rng.uniform(3.0, 7.0, shape),
        tex_phase=rng.uniform(0, 1, shape),
        tex_k=rng.uniform(0.5, 1.0, shape),
    )


def _texture(tex, ang, period, phase, cx, cy, extent, px, py):
    """Texture weight in [0, 1] at pixel centres ``(px, py)``; parameters are
    arrays of the same (flat) shape as ``px``."""
    f = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    dx, dy = px - f(cx), py - f(cy)
    ang = f(ang)
    ca, sa = np.cos(ang), np.sin(ang)
    a = dx * ca + dy * sa
    b = -dx * sa + dy * ca
    per, ph = f(period), f(phase)
    stripes = np.mod(np.floor(a / per * 2.0 + ph * 2.0), 2.0)
    checker = np.mod(np.floor(a / per + ph) + np.floor(b / per + ph), 2.0)
    grad = np.clip(0.5 + a / (2.0 * f(extent)), 0.0, 1.0)
    t = np.asarray(tex)
    out = np.where(t == 1, stripes, np.where(t == 2, checker, np.where(t == 3, grad, 0.0)))
    return out.astype(np.float32)


def _paint(pixels, idx, mask, color, color2, k, tex, tex_angle, tex_period, tex_phase,
           cx, cy, extent):
    """Paint textured shapes.  ``mask`` (m, H, W) selects pixels of ``pixels[idx]``;
    all other arguments are (m,)-arrays (colours (m, 3))."""
    ii, yy, xx = np.nonzero(mask)
    if len(ii) == 0:
        return
    px = xx.astype(np.float32) + 0.5
    py = yy.astype(np.float32) + 0.5
    texw = _texture(np.asarray(tex)[ii], np.asarray(tex_angle)[ii], np.asarray(tex_period)[ii],
                    np.asarray(tex_phase)[ii], np.asarray(cx)[ii], np.asarray(cy)[ii],
                    np.asarray(extent)[ii], px, py)
    kk = (texw * np.asarray(k, np.float32)[ii])[:, None]
    col = np.asarray(color, np.float32)[ii]
    col2 = np.asarray(color2, np.float32)[ii]
    pixels[np.asarray(idx)[ii], yy, xx] = col * (1.0 - kk) + col2 * kk


def _object_mask(cls, cx, cy, scale, angle, ax, ay, x, y):
    """Masks (m, H, W) for objects given (m,) parameter arrays of one class."""
    e = lambda a: np.asarray(a, dtype=np.float32)[:, None, None]  # noqa: E731
    dx, dy = x - e(cx), y - e(cy)
    ca, sa = e(np.cos(angle)), e(np.sin(angle))
    u = (dx * ca + dy * sa) / e(scale * ax)
    v = (-dx * sa + dy * ca) / e(scale * ay)
    return _inside(int(cls), u, v)


def _paint_objects(pixels, idx, mask, p, sel):
    _paint(pixels, idx, mask, p["color"][sel], p["color2"][sel], p["tex_k"][sel], p["tex"][sel],
           p["tex_angle"][sel], p["tex_period"][sel], p["tex_phase"][sel], p["cx"][sel],
           p["cy"][sel], p["scale"][sel])


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    out = mask.copy()
    for s in range(1, r + 1):
        out[..., s:, :] |= mask[..., :-s, :]
        out[..., :-s, :] |= mask[..., s:, :]
    m2 = out.copy()
    for s in range(1, r + 1):
        out[..., :, s:] |= m2[..., :, :-s]
        out[..., :, :-s] |= m2[..., :, s:]
    return out


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------
@dataclass
class Scenes:
    """A batch of rendered scenes.

    images : torch.float32 (n, 3, H, W), normalised with :data:`MEAN`/:data:`STD`
    pixels : numpy uint8 (n, H, W, 3)
    labels : torch.long (n, objects), class indices into :data:`CLASSES`
    masks  : torch.bool (n, objects, H, W), exactly the pixels painted per object
    params : dict of numpy arrays of shape (n, objects[, 3]) describing every
             object (see :func:`render_object`)
    """

    images: torch.Tensor
    pixels: np.ndarray
    labels: torch.Tensor
    masks: torch.Tensor
    params: dict = field(repr=False)
    seed: int = 0

    def __len__(self) -> int:
        return self.pixels.shape[0]

    @property
    def objects(self) -> int:
        return self.labels.shape[1]

    def object_params(self, i: int, j: int = 0) -> dict:
        """Parameters of object ``j`` of scene ``i``, for :func:`render_object`."""
        return {k: v[i, j] for k, v in self.params.items()}


_LUT = ((np.arange(256, dtype=np.float32)[None, :] / 255.0 - np.asarray(MEAN, np.float32)[:, None])
        / np.asarray(STD, np.float32)[:, None])  # (3, 256)


def normalize(pixels: np.ndarray) -> torch.Tensor:
    """uint8 (n, H, W, 3) -> normalised float32 tensor (n, 3, H, W)."""
    chw = np.ascontiguousarray(np.asarray(pixels, np.uint8).transpose(0, 3, 1, 2))
    out = np.empty(chw.shape, np.float32)
    for c in range(3):
        out[:, c] = _LUT[c][chw[:, c]]
    return torch.from_numpy(out)


def render_object(cls, cx, cy, scale, angle, ax, ay, color, color2, tex, tex_angle,
                  tex_period, tex_phase, tex_k, size: int = IMAGE_SIZE):
    """Render one object alone on a black background.

    Returns ``(pixels uint8 (H, W, 3), mask bool (H, W))``; pixels and mask are
    identical to what :func:`make_scenes` paints for the same parameters.
    """
    x, y = _grid(size)
    a1 = lambda v: np.asarray([v])  # noqa: E731
    p = dict(tex=a1(tex), tex_angle=a1(tex_angle), tex_period=a1(tex_period),
             tex_phase=a1(tex_phase), cx=a1(cx), cy=a1(cy), scale=a1(scale), tex_k=a1(tex_k),
             color=np.asarray(color)[None], color2=np.asarray(color2)[None])
    mask = _object_mask(int(cls), a1(cx), a1(cy), a1(scale), a1(angle), a1(ax), a1(ay), x, y)
    pixels = np.zeros((1, size, size, 3), np.float32)
    _paint_objects(pixels, np.array([0]), mask, p, slice(None))
    return np.clip(np.rint(pixels[0]), 0, 255).astype(np.uint8), mask[0]


def _sample_params(rng, n, objects, size):
    C = len(CLASSES)
    cls = np.empty((n, objects), np.int64)
    cls[:, 0] = rng.integers(0, C, n)
    if objects >= 2:
        cls[:, 1] = (cls[:, 0] + rng.integers(1, C, n)) % C
    if objects == 3:  # a third class, uniform over the C - 2 unused ones
        third = rng.integers(0, C - 2, n)
        low, high = np.minimum(cls[:, 0], cls[:, 1]), np.maximum(cls[:, 0], cls[:, 1])
        third = third + (third >= low)
        cls[:, 2] = third + (third >= high)
    lo, hi = {1: SINGLE_SCALE, 2: PAIR_SCALE, 3: TRIPLE_SCALE}[objects]
    scale = rng.uniform(lo, hi, (n, objects))
    ax = rng.uniform(0.9, 1.1, (n, objects))
    ay = rng.uniform(0.9, 1.1, (n, objects))
    angle = rng.uniform(-MAX_ROTATION, MAX_ROTATION, (n, objects))
    rad = BOUND * scale
    cx = np.empty((n, objects))
    cy = np.empty((n, objects))
    todo = np.ones(n, bool)
    for _ in range(PLACEMENT_ROUNDS):  # redraw both positions until the discs are apart
        idx = np.flatnonzero(todo)
        u = rng.random((idx.size, 2 * objects))
        for j in range(objects):
            span = size - 2 * rad[idx, j]
            cx[idx, j] = rad[idx, j] + u[:, 2 * j] * span
            cy[idx, j] = rad[idx, j] + u[:, 2 * j + 1] * span
        apart = np.ones(n, bool)
        for a in range(objects):
            for b in range(a + 1, objects):
                apart &= (np.hypot(cx[:, b] - cx[:, a], cy[:, b] - cy[:, a])
                          >= rad[:, a] + rad[:, b] + MIN_GAP)
        todo &= ~apart
        if not todo.any():
            break
    if todo.any():  # rare fallback: fixed far-apart places at minimum size
        scale[todo] = lo
        rad = BOUND * scale
        r0 = rad[todo, 0]
        corners = [(r0, r0), (size - r0, size - r0)] if objects == 2 else \
            [(r0, r0), (size - r0, r0), (np.full_like(r0, size / 2), size - r0)]
        for j, (x0, y0) in enumerate(corners):
            cx[todo, j], cy[todo, j] = x0, y0
    return dict(cls=cls, cx=cx, cy=cy, scale=scale, angle=angle, ax=ax, ay=ay)


def make_scenes(n: int, seed: int = 0, objects: int = 1, size: int = IMAGE_SIZE,
                chunk: int = 512, clutter=1.0) -> Scenes:
    """Render ``n`` scenes with ``objects`` (1, 2 or 3) objects each, of distinct classes.

    Deterministic for ``(n, seed, objects, size, clutter)``.  ``clutter`` (a
    float or an (n,) array in [0, 1], default 1 = the benchmark setting) scales
    the number of distractors, the pixel noise and the texture contrast; lower
    values are only used for a training curriculum.
    """
    clutter = np.broadcast_to(np.clip(np.asarray(clutter, np.float64), 0.0, 1.0), (n,))
    if objects not in (1, 2, 3):
        raise ValueError(f"objects must be 1, 2 or 3, got {objects!r}")
    rng = np.random.default_rng(seed)
    p = _sample_params(rng, n, objects, size)

    # background
    bg_a = _hsv_to_rgb(rng.random(n), rng.uniform(0, 0.7, n), rng.uniform(0.15, 0.95, n))
    bg_b = _hsv_to_rgb(rng.random(n), rng.uniform(0, 0.7, n), rng.uniform(0.15, 0.95, n))
    bg_angle = rng.uniform(0, 2 * np.pi, n)
    noise_sigma = rng.uniform(2.0, 14.0, n) * clutter
    bg_mean = 0.5 * (bg_a + bg_b)

    # object colours and textures
    p["color"] = _sample_colors(rng, (n, objects), bg_mean)
    p["color2"] = _variant(rng, p["color"])
    p.update(_sample_textures(rng, (n, objects)))
    p["tex_k"] = np.where(p["tex"] == 0, 0.0, p["tex_k"] * clutter[:, None])

    # distractors
    D = N_DISTRACTOR_SLOTS
    d = dict(
        active=np.arange(D)[None, :] < np.floor(rng.integers(2, D + 1, n) * clutter + 0.5)[:, None],
        kind=rng.integers(0, 4, (n, D)),  # 0 segment, 1 ellipse, 2 arc, 3 dot
        cx=rng.uniform(0, size, (n, D)),
        cy=rng.uniform(0, size, (n, D)),
        angle=rng.uniform(0, 2 * np.pi, (n, D)),
        length=rng.uniform(8.0, 30.0, (n, D)),
        width=rng.uniform(1.2, 3.2, (n, D)),
        a=rng.uniform(3.0, 9.0, (n, D)),
        aspect=rng.uniform(2.2, 4.0, (n, D)),
        radius=rng.uniform(5.0, 12.0, (n, D)),
        span=rng.uniform(np.pi / 4, np.pi, (n, D)),
        dot=rng.uniform(1.2, 3.0, (n, D)),
    )
    dcol = _sample_colors(rng, (n, D), bg_mean)
    copy = rng.random((n, D)) < 0.35
    src = rng.integers(0, objects, (n, D))
    dcol = np.where(copy[..., None], np.take_along_axis(p["color"], src[..., None], 1), dcol)
    d["color"] = dcol
    d["color2"] = _variant(rng, dcol)
    d.update(_sample_textures(rng, (n, D)))
    noise_seed = int(rng.integers(0, 2**63 - 1))

    pixels_out = np.empty((n, size, size, 3), np.uint8)
    masks_out = np.empty((n, objects, size, size), bool)
    x, y = _grid(size)
    for s in range(0, n, chunk):
        sl = slice(s, min(n, s + chunk))
        m = sl.stop - sl.start
        crng = np.random.default_rng([noise_seed, s])
        # gradient background + noise
        ang = bg_angle[sl].astype(np.float32)[:, None, None]
        t = ((x - size / 2) * np.cos(ang) + (y - size / 2) * np.sin(ang)) / size + 0.5
        t = np.clip(t, 0, 1).astype(np.float32)[..., None]
        ba = bg_a[sl].astype(np.float32)[:, None, None, :]
        bb = bg_b[sl].astype(np.float32)[:, None, None, :]
        pix = ba + (bb - ba) * t
        noise = crng.standard_normal((m, size, size, 1), dtype=np.float32)
        pix = pix.astype(np.float32) + noise * noise_sigma[sl][:, None, None, None].astype(np.float32)

        # object masks
        masks = np.zeros((m, objects, size, size), bool)
        for j in range(objects):
            cl = p["cls"][sl, j]
            for k in np.unique(cl):
                g = np.nonzero(cl == k)[0]
                gs = g + s
                masks[g, j] = _object_mask(
                    k, p["cx"][gs, j], p["cy"][gs, j], p["scale"][gs, j], p["angle"][gs, j],
                    p["ax"][gs, j], p["ay"][gs, j], x, y)
        free = ~_dilate(masks.any(1), HALO)

        # distractors
        for j in range(D):
            act = d["active"][sl, j]
            kind = d["kind"][sl, j]
            for k in range(4):
                g = np.nonzero(act & (kind == k))[0]
                if len(g) == 0:
                    continue
                gs = g + s
                e = lambda a: np.asarray(a[gs, j], np.float32)[:, None, None]  # noqa: E731,B023
                dx, dy = x - e(d["cx"]), y - e(d["cy"])
                ca, sa = np.cos(e(d["angle"])), np.sin(e(d["angle"]))
                u = dx * ca + dy * sa
                v = -dx * sa + dy * ca
                if k == 0:
                    half = e(d["length"]) / 2
                    uc = np.clip(u, -half, half)
                    mk = (u - uc) ** 2 + v**2 <= (e(d["width"]) / 2) ** 2
                elif k == 1:
                    a_ = e(d["a"])
                    b_ = a_ / e(d["aspect"])
                    mk = (u / a_) ** 2 + (v / b_) ** 2 <= 1.0
                elif k == 2:
                    r = np.sqrt(u * u + v * v)
                    th = np.abs(np.arctan2(v, u))
                    mk = (np.abs(r - e(d["radius"])) <= e(d["width"]) / 2) & \
                        (th <= e(d["span"]) / 2)
                else:
                    mk = u * u + v * v <= e(d["dot"]) ** 2
                mk &= free[g]
                _paint(pix, g, mk, d["color"][gs, j], d["color2"][gs, j], d["tex_k"][gs, j],
                       d["tex"][gs, j], d["tex_angle"][gs, j], d["tex_period"][gs, j],
                       d["tex_phase"][gs, j], d["cx"][gs, j], d["cy"][gs, j],
                       d["length"][gs, j] / 2)

        # objects, painted last
        for j in range(objects):
            cl = p["cls"][sl, j]
            for k in np.unique(cl):
                g = np.nonzero(cl == k)[0]
                gs = g + s
                pj = {key: val[:, j] for key, val in p.items()}
                _paint_objects(pix, g, masks[g, j], pj, gs)
        pixels_out[sl] = np.clip(np.rint(pix), 0, 255).astype(np.uint8)
        masks_out[sl] = masks

    return Scenes(
        images=normalize(pixels_out),
        pixels=pixels_out,
        labels=torch.from_numpy(p["cls"].copy()),
        masks=torch.from_numpy(masks_out),
        params={k: v for k, v in p.items()},
        seed=seed,
    )

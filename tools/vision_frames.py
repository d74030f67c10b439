"""Synthetic camera frames for the vision demo model (tools/build_vision_model.py): a control panel
with one indicator lamp that is off, green, amber or red, under clutter (panel texture, stickers of
any colour and screws, lighting level, colour cast and gradient, exposure and white balance, sensor
noise, the lamp's position, size and brightness). numpy only, deterministic for a given generator.
"""

from __future__ import annotations

import numpy as np

HEIGHT, WIDTH = 480, 640
LABELS = ("off", "green", "amber", "red")
N_CLASSES = len(LABELS)

# Lit lamp colours (RGB, 0-255) by class id; class 0 is off.
LAMP_RGB = {1: (40.0, 235.0, 90.0), 2: (255.0, 165.0, 20.0), 3: (245.0, 40.0, 30.0)}


def _upsample_rows(coarse: np.ndarray, n_out: int) -> np.ndarray:
    """Linear interpolation of ``coarse`` along axis 1 to ``n_out`` rows: with axis 2 done the
    same way, a smooth full-resolution texture from a 13x17 random field, cheaply."""
    n_in = coarse.shape[1]
    pos = np.linspace(0, n_in - 1, n_out, dtype=np.float32)
    lo = np.minimum(pos.astype(int), n_in - 2)
    frac = (pos - lo)[:, None]
    return coarse[:, lo] * (1 - frac) + coarse[:, lo + 1] * frac


_YY = np.arange(HEIGHT, dtype=np.float32)[:, None]
_XX = np.arange(WIDTH, dtype=np.float32)[None, :]
# The panel is drawn at half resolution and repeated 2x2 (a quarter of the cost; generation is
# most of the build's time); the lamp, the lighting on it, the noise and the camera are full resolution.
_YY2, _XX2 = _YY[::2] + 0.5, _XX[:, ::2] + 0.5


def _panel(rng: np.random.Generator) -> np.ndarray:
    """Reflectance of the panel at half resolution (float32 [3, H/2, W/2], channels first:
    broadcasting a plane over it is fast), 0-1: a tinted base, smooth blotches, a brushed
    grating, 0-3 stickers (any colour, saturated red, orange and green ones too), 0-4 screws."""
    coarse = rng.normal(0, rng.uniform(0.02, 0.08), (3, 13, 17)).astype(np.float32)
    across = _upsample_rows(coarse.transpose(0, 2, 1), WIDTH // 2).transpose(0, 2, 1)
    scene = _upsample_rows(across, HEIGHT // 2)  # smooth blotches
    # A brushed grating sin(u x + v y + p), as sin(u x) cos(v y + p) + cos(u x) sin(v y + p).
    angle, freq, depth = rng.uniform(0, np.pi), rng.uniform(0.05, 0.4), np.float32(rng.uniform(0, 0.05))
    u, v, p = freq * np.cos(angle), freq * np.sin(angle), rng.uniform(0, 6.3)
    scene += (np.sin(u * _XX2) * depth) * np.cos(v * _YY2 + p)
    scene += (np.cos(u * _XX2) * depth) * np.sin(v * _YY2 + p)
    scene += (rng.uniform(0.25, 0.7) + rng.uniform(-0.08, 0.08, size=3)).astype(np.float32)[:, None, None]
    for _ in range(rng.integers(0, 4)):  # stickers and labels
        h, w = rng.integers(10, 70, size=2)
        y, x = rng.integers(0, HEIGHT // 2 - h), rng.integers(0, WIDTH // 2 - w)
        colour = rng.uniform(0.05, 0.75, size=3)
        if rng.random() < 0.35:  # a saturated one (red, orange, green, ...): the hardest clutter
            colour = np.array([0.6, 0.1, 0.1]) if rng.random() < 0.5 else rng.permutation([0.6, 0.35, 0.08])
        scene[:, y : y + h, x : x + w] = colour[:, None, None]
    for _ in range(rng.integers(0, 5)):  # screws: small grey disks
        r = rng.uniform(2, 5)
        cy, cx = int(rng.uniform(5, HEIGHT // 2 - 5)), int(rng.uniform(5, WIDTH // 2 - 5))
        ys, xs = slice(cy - 5, cy + 5), slice(cx - 5, cx + 5)
        disk = (np.arange(-5, 5)[:, None] ** 2 + np.arange(-5, 5)[None, :] ** 2) < r * r
        scene[:, ys, xs][:, disk] = rng.uniform(0.3, 0.8)
    return scene


def render(label: int, rng: np.random.Generator, noise: np.ndarray) -> np.ndarray:
    """One frame of a panel whose lamp is in state ``label``, channels first (uint8 [3, H, W])."""
    # Lighting: level, colour cast and a gradient across the frame, on everything reflective.
    light = (rng.uniform(0.4, 1.1) * 255.0 * rng.uniform(0.8, 1.2, size=3)).astype(np.float32)[:, None, None]
    gx, gy = rng.uniform(-0.5, 0.5, size=2)

    def lit(reflectance: np.ndarray, yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
        out = reflectance * (1 + gx * (xx / WIDTH - 0.5) + gy * (yy / HEIGHT - 0.5))
        out *= light
        return out

    half = lit(_panel(rng), _YY2, _XX2)
    frame = np.broadcast_to(half[:, :, None, :, None], (3, HEIGHT // 2, 2, WIDTH // 2, 2)).reshape(3, HEIGHT, WIDTH)

    # The lamp: a black bezel, a lens (a reflector like the rest when unlit), a specular highlight
    # and, when lit, a colour disk with a whiter core and a halo on the bezel and the panel around it.
    r = rng.uniform(18.0, 50.0)  # lens radius, px
    cy, cx = rng.uniform(1.6 * r, HEIGHT - 1.6 * r), rng.uniform(1.6 * r, WIDTH - 1.6 * r)
    ys = slice(int(max(cy - 3.5 * r, 0)), int(min(cy + 3.5 * r, HEIGHT)))
    xs = slice(int(max(cx - 3.5 * r, 0)), int(min(cx + 3.5 * r, WIDTH)))
    yy, xx = _YY[ys], _XX[:, xs]
    d = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)  # distance to the lamp's centre, [h, w]
    bezel = lit(np.full((3, 1, 1), rng.uniform(0.05, 0.15), np.float32), yy, xx)
    lens = lit((rng.uniform(0.3, 0.5) + rng.uniform(-0.05, 0.05, size=3)).astype(np.float32)[:, None, None], yy, xx)
    local = np.where(d < r, lens, np.where(d < 1.3 * r, bezel, frame[:, ys, xs]))
    dh2 = (yy - (cy - 0.4 * r)) ** 2 + (xx - (cx - 0.35 * r)) ** 2
    local += np.float32(rng.uniform(0.1, 0.8) * 255.0) * np.exp(-dh2 / np.float32(2 * (0.15 * r) ** 2))
    if label:
        colour = np.clip(np.array(LAMP_RGB[label]) + rng.normal(0, 10, size=3), 0, 255).astype(np.float32)
        colour *= np.float32(rng.uniform(0.7, 1.0))  # brightness of the lamp
        core = rng.uniform(0.1, 0.5) * np.exp(-((d / (0.55 * r)) ** 2))
        disk = colour[:, None, None] * (1 - core) + colour.max() * core
        halo = colour[:, None, None] * np.exp(-np.maximum(d - r, 0) / (0.4 * r)) * np.float32(rng.uniform(0.1, 0.5))
        local += np.where(d < r, disk, halo)
    frame[:, ys, xs] = local

    # Camera: exposure, white balance, sensor noise (a random window of a precomputed field).
    frame *= (rng.uniform(0.75, 1.15) * rng.uniform(0.92, 1.08, size=3)).astype(np.float32)[:, None, None]
    oy, ox = rng.integers(0, noise.shape[1] - HEIGHT), rng.integers(0, noise.shape[2] - WIDTH)
    frame += np.float32(rng.uniform(2.0, 10.0)) * noise[:, oy : oy + HEIGHT, ox : ox + WIDTH]
    frame += np.float32(0.5)
    return np.clip(frame, 0, 255, out=frame).astype(np.uint8)


def noise_field(seed: int) -> np.ndarray:
    """Unit Gaussian noise (float32 [3, 1.5 H, 1.5 W]) that frames take random windows of."""
    return np.random.default_rng([seed, 99]).standard_normal((3, HEIGHT * 3 // 2, WIDTH * 3 // 2), np.float32)


def generate(n: int, rng: np.random.Generator, noise: np.ndarray,
             channels_first: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``n`` frames (uint8 [n, 480, 640, 3], the model's input, or [n, 3, 480, 640], which
    training featurises without the cost of the transpose) and their lamp states (int64 [n]),
    classes balanced."""
    y = rng.permutation(np.arange(n) % N_CLASSES).astype(np.int64)
    frames = np.stack([render(int(c), rng, noise) for c in y])
    return (frames if channels_first else np.ascontiguousarray(frames.transpose(0, 2, 3, 1))), y

"""Visual reasoning problems drawn with Pillow at run time (no download), with held-out splits.

    count   "How many <colour> shapes are in the image?"  circles, squares and triangles in
            several colours on a small canvas, none overlapping; answer: the count (0 allowed)
    tallest "Bars are numbered 1 to K from the left. Which bar is tallest?"  answer: its number
    clock   "What time does the clock show, in minutes after 12:00?"  an analog face with hour
            and minute hands at 5-minute steps; answer: 60 h + m (minutes, so the math verifier
            never reads "h:mm" as a ratio)

Every answer is a plain integer that `rljax.rewards.math` verifies. A problem is a pure function
of (task, index, size): its own generator `default_rng([task, index])`. The split is by content:
a problem belongs to the held-out split when a hash of its drawing spec (every shape, colour and
position) falls in the held-out fraction, so no held-out picture is ever a training picture
(a split by index alone could draw the same picture on both sides). Small canvases (the default
112 px is 4 windows of Qwen2.5-VL's 28-px merge blocks per side) keep the tower cheap on a CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json

import numpy as np

from rljax.errors import DataError

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 70, 220), "yellow": (230, 200, 20),
           "purple": (140, 40, 170)}
TASKS = ("count", "tallest", "clock")
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class VisualProblem:
    """One generated problem: its picture (RGB uint8 [H, W, 3]), question, integer answer and the
    drawing spec it was rendered from (what the split hashes)."""

    task: str
    question: str
    answer: str
    image_hw3: np.ndarray
    spec: tuple

    def png(self) -> bytes:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(self.image_hw3).save(buf, format="PNG")
        return buf.getvalue()


def _spec_count(rng, size):
    n = int(rng.integers(2, 8))
    cell = size // 4
    cells = rng.choice(16, size=n, replace=False)  # one shape per cell of a 4 x 4 grid: never overlapping
    shapes = tuple((int(c), str(rng.choice(["circle", "square", "triangle"])), str(rng.choice(list(COLOURS))),
                    int(rng.integers(cell // 3, cell // 2))) for c in sorted(cells))
    target = str(rng.choice(list(COLOURS)))
    return ("count", size, target, shapes)


def _spec_tallest(rng, size):
    k = int(rng.integers(3, 6))
    heights = rng.choice(np.arange(size // 8, size - 8), size=k, replace=False)  # distinct: one tallest
    colours = rng.choice(list(COLOURS), size=k)
    return ("tallest", size, tuple(int(h) for h in heights), tuple(str(c) for c in colours))


def _spec_clock(rng, size):
    return ("clock", size, int(rng.integers(0, 12)), int(rng.integers(0, 12)) * 5)


def _render(spec):
    from PIL import Image, ImageDraw

    size = spec[1]
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    if spec[0] == "count":
        cell = size // 4
        for c, kind, colour, r in spec[3]:
            cx, cy = (c % 4) * cell + cell // 2, (c // 4) * cell + cell // 2
            box = (cx - r, cy - r, cx + r, cy + r)
            fill = COLOURS[colour]
            if kind == "circle":
                draw.ellipse(box, fill=fill)
            elif kind == "square":
                draw.rectangle(box, fill=fill)
            else:
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    elif spec[0] == "tallest":
        heights, colours = spec[2], spec[3]
        width = size // len(heights)
        for i, (h, colour) in enumerate(zip(heights, colours)):
            draw.rectangle((i * width + 2, size - h, (i + 1) * width - 3, size - 1), fill=COLOURS[colour])
    else:
        hours, minutes = spec[2], spec[3]
        c, r = size / 2, size / 2 - 3
        draw.ellipse((c - r, c - r, c + r, c + r), outline=(0, 0, 0), width=2)
        for tick in range(12):
            a = 2 * np.pi * tick / 12
            draw.line((c + 0.85 * r * np.sin(a), c - 0.85 * r * np.cos(a), c + r * np.sin(a), c - r * np.cos(a)),
                      fill=(0, 0, 0), width=2)
        for frac, length, width in ((((hours % 12) + minutes / 60) / 12, 0.5, 4), (minutes / 60, 0.85, 2)):
            a = 2 * np.pi * frac
            draw.line((c, c, c + length * r * np.sin(a), c - length * r * np.cos(a)), fill=(0, 0, 0), width=width)
    return np.asarray(image)


def _question_answer(spec) -> tuple[str, str]:
    if spec[0] == "count":
        return (f"How many {spec[2]} shapes are in the image? Answer with a number.",
                str(sum(colour == spec[2] for _, _, colour, _ in spec[3])))
    if spec[0] == "tallest":
        return (f"The bars are numbered 1 to {len(spec[2])} from the left. Which bar is the tallest? "
                "Answer with its number.", str(int(np.argmax(spec[2])) + 1))
    return ("What time does the clock show? Answer in minutes after 12 o'clock (for example 2:30 is 150).",
            str(60 * spec[2] + spec[3]))


def spec_split(spec, held_out_fraction: float = 0.2) -> str:
    """'test' when the spec's hash falls in the held-out fraction, else 'train'."""
    digest = hashlib.sha256(json.dumps(spec).encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2.0**64 < held_out_fraction else "train"


def generate(task: str, split: str, count: int, *, size: int = 112, held_out_fraction: float = 0.2,
             start: int = 0) -> list[VisualProblem]:
    """`count` problems of `task` in `split`, drawn in index order from `start` (deterministic)."""
    if task not in TASKS:
        raise DataError(f"visual task {task!r} is unknown; choose one of {TASKS}")
    if split not in SPLITS:
        raise DataError(f"split {split!r} is unknown; choose one of {SPLITS}")
    if size < 56 or size % 28:
        raise DataError(f"image size {size} must be a multiple of 28 and at least 56")
    make = {"count": _spec_count, "tallest": _spec_tallest, "clock": _spec_clock}[task]
    out, index = [], start
    while len(out) < count:
        spec = make(np.random.default_rng([TASKS.index(task), index]), size)
        index += 1
        if spec_split(spec, held_out_fraction) != split:
            continue
        question, answer = _question_answer(spec)
        out.append(VisualProblem(task, question, answer, _render(spec), spec))
    return out

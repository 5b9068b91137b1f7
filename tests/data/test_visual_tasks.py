"""Generated visual problems: answers recounted from the pixels, content-disjoint splits."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage

from rljax.data.visual_tasks import COLOURS, generate
from rljax.errors import DataError
from rljax.rewards.math import math_verify


def test_count_answers_equal_the_pixels():
    """The count answer is the number of connected regions of exactly the asked colour in the
    picture (counting every shape, or the wrong colour, fails)."""
    for p in generate("count", "train", 30):
        colour = p.question.split()[2]
        regions = scipy.ndimage.label((p.image_hw3 == COLOURS[colour]).all(axis=-1))[1]
        assert str(regions) == p.answer, (p.spec, regions)


def test_tallest_answer_equals_the_pixels():
    """The tallest bar's number is the column band with the most coloured rows (bands split
    evenly by the number of bars the question names)."""
    for p in generate("tallest", "test", 30):
        k = int(p.question.split(" to ")[1].split()[0])
        painted = (p.image_hw3 != 255).any(axis=-1)  # [H, W]
        band = p.image_hw3.shape[1] // k
        heights = [painted[:, i * band:(i + 1) * band].any(axis=1).sum() for i in range(k)]
        assert str(int(np.argmax(heights)) + 1) == p.answer


def test_clock_answer_in_minutes_is_verified():
    """Clock answers are minutes after 12 (0..715, multiples of 5) that the math verifier accepts
    boxed, and refuses as h:mm."""
    for p in generate("clock", "train", 10):
        minutes = int(p.answer)
        assert 0 <= minutes < 720 and minutes % 5 == 0
        assert math_verify(f"The hands show it. \\boxed{{{minutes}}}", p.answer) == 1.0
        assert math_verify(f"\\boxed{{{minutes // 60}:{minutes % 60:02d}}}", p.answer) == 0.0


def test_splits_are_disjoint_and_deterministic():
    """No held-out picture is a training picture, and the same call draws the same problems."""
    for task in ("count", "tallest", "clock"):
        train, test = generate(task, "train", 60), generate(task, "test", 15)
        assert not {p.spec for p in train} & {p.spec for p in test}
        again = generate(task, "test", 15)
        assert all((a.image_hw3 == b.image_hw3).all() and a.answer == b.answer for a, b in zip(test, again))


def test_bad_task_is_one_line():
    with pytest.raises(DataError, match="unknown"):
        generate("colour", "train", 1)

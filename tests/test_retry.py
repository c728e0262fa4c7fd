"""``unicon.evaluation.retry.images_by_row``: a failing batch of images is retried one row at a
time, so that one bad row costs only itself (``None`` and its error text); preemption and a
backend without the method stop the run instead of being scored."""

from __future__ import annotations

import pytest
from PIL import Image

from unicon.evaluation import preemption
from unicon.evaluation.retry import images_by_row


def drawer(bad: set[int], calls: list[list[int]], result=None):
    """``call(rows)``: a 1x1 image per row, raising when the batch holds a row of ``bad``;
    ``result(row)`` (when given) replaces the image of a row."""

    def call(rows):
        calls.append(list(rows))
        if bad & set(rows):
            raise ValueError(f"cannot draw row {sorted(bad & set(rows))[0]}")
        return [Image.new("RGB", (1, 1)) if result is None else result(r) for r in rows]

    return call


def test_a_batch_that_succeeds_is_called_once():
    calls: list[list[int]] = []
    images, errors = images_by_row(drawer(set(), calls), [3, 5], "generate_image")
    assert calls == [[3, 5]] and errors == [None, None] and all(isinstance(im, Image.Image) for im in images)


def test_a_failing_batch_is_retried_row_by_row():
    calls: list[list[int]] = []
    images, errors = images_by_row(drawer({5}, calls), [3, 5, 7], "edit_image")
    assert calls == [[3, 5, 7], [3], [5], [7]]
    assert [im is None for im in images] == [False, True, False]
    assert errors == [None, "ValueError: cannot draw row 5", None]


def test_a_wrong_result_fails_its_row_or_the_batch():
    calls: list[list[int]] = []
    images, errors = images_by_row(drawer(set(), calls, result=lambda r: "text" if r == 1 else Image.new("L", (1, 1))),
                                   [0, 1], "generate_image")
    assert calls == [[0, 1]] and images[1] is None and errors == [None, "generate_image returned str, not a PIL image"]
    calls.clear()
    short = lambda rows: calls.append(list(rows)) or [Image.new("L", (1, 1))]  # noqa: E731 -- one image, always
    images, errors = images_by_row(short, [0, 1], "generate_image")
    assert calls == [[0, 1], [0], [1]] and errors == [None, None]  # the batch's count was wrong, each row's is right


@pytest.mark.parametrize("error", [preemption.Preempted(15), NotImplementedError("no edit_image")])
def test_preemption_and_a_missing_method_are_raised(error):
    def call(rows):
        raise error

    with pytest.raises(type(error)):
        images_by_row(call, [0, 1], "edit_image")

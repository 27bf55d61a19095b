"""TensorBoard's own reader reads the event files odc's examples write (``--tensorboard DIR``).

``tests/python.rs`` writes the file with ``odc::recipe::tensorboard`` and names its directory in
``ODC_TENSORBOARD_EVENTS``: losses 4/step and MFU 0.01·step at steps 1–3, and ``eval_loss`` 1.5
at step 3.
"""

import os

import pytest


def test_tensorboards_reader_reads_odcs_scalars():
    directory = os.environ.get("ODC_TENSORBOARD_EVENTS")
    if not directory:
        pytest.skip("ODC_TENSORBOARD_EVENTS is not set (tests/python.rs sets it)")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    acc = event_accumulator.EventAccumulator(directory)
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["eval_loss", "loss", "mfu"]
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert loss == [(1, 4.0), (2, 2.0), (3, pytest.approx(4.0 / 3, rel=1e-6))]
    mfu = [e.value for e in acc.Scalars("mfu")]
    assert mfu == pytest.approx([0.01, 0.02, 0.03], rel=1e-6)
    assert [(e.step, e.value) for e in acc.Scalars("eval_loss")] == [(3, 1.5)]
    assert all(e.wall_time > 1.6e9 for e in acc.Scalars("loss"))

"""The one number formatter of the studies' prose and verdicts (``vae_ddp.harness.table.number``)."""

import pytest

from vae_ddp.harness.table import number


@pytest.mark.parametrize("value, kwargs, text", [
    (0.10912, {}, "0.109"), (12.54, {}, "12.5"), (1.0, {}, "1"), (3e-05, {}, "3e-05"), (None, {}, "-"),
    (0.1, {"zeros": True}, "0.100"), (100.0, {"zeros": True}, "100"), (1.03, {"zeros": True}, "1.03"),
    (2.5e-4, {"sci_below": 1e-3}, "2.50e-04"), (0.0, {"sci_below": 1e-3}, "0"), (None, {"none": "inf"}, "inf"),
    (0.0123456, {"digits": 2}, "0.012"),
])
def test_number(value, kwargs, text):
    assert number(value, **kwargs) == text

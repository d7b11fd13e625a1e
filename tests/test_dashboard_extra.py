"""``scheduler.dashboard()`` without the ``dashboard`` extra says which extra to install."""

from __future__ import annotations

import sys

import pytest

from ticklock import Scheduler


@pytest.mark.parametrize("module", ["jinja2", "starlette"])
def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    for name in [module, *(n for n in sys.modules if n.startswith(f"{module}."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    for loaded in [
        name for name in sys.modules if name.startswith("ticklock._operators.dashboard")
    ]:
        monkeypatch.delitem(sys.modules, loaded)  # imported again, and put back after the test
    scheduler = Scheduler()
    with pytest.raises(ModuleNotFoundError) as raised:
        scheduler.dashboard()
    assert str(raised.value) == (
        f"scheduler.dashboard() needs its extra: pip install 'ticklock[dashboard]' ({module} is "
        "not installed)"
    )
    assert raised.value.name == module

"""RequestOutput snapshots: a step's output keeps its length after later steps append."""
from engine.outputs import Prefix


def test_prefix_is_a_stable_snapshot_of_a_growing_list():
    items = [1, 2, 3]
    snap = Prefix(items)
    items.append(4)
    assert len(snap) == 3 and snap == [1, 2, 3] and list(snap) == [1, 2, 3]
    assert snap[-1] == 3 and snap[0] == 1 and snap[1:] == [2, 3] and snap[::-1] == [3, 2, 1]
    assert snap != [1, 2, 3, 4] and Prefix(items) == [1, 2, 3, 4]
    try:
        snap[3]
        raise AssertionError("index past the snapshot must fail")
    except IndexError:
        pass

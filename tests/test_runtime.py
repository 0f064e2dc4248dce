"""The replica worker's determinism digest: content, not batch layout."""

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.runtime import CycleDigest

TABLE = pa.table(
    {
        "i": pa.array([1, None, 3, 4, 5, 6, None, 8]),
        "s": pa.array(["x", "yy", None, "", "zzz", "w", "v", None]),
        "f": pa.array([0.5, 1.5, None, 2.0, 3.0, 4.0, 5.0, 6.0]),
        "b": pa.array([True, None, False, True, True, False, None, True]),
        "t": pa.array([1, 2, None, 4, 5, 6, 7, 8], pa.timestamp("us")),
    }
)


def digest(table: pa.Table, cuts: list[int]) -> str:
    d, off = CycleDigest(), 0
    for n in cuts:
        d.add(table.slice(off, n).combine_chunks().to_batches()[0])
        off += n
    d.close(1)
    return d.done[1]


@st.composite
def splits(draw, total: int = TABLE.num_rows) -> list[int]:
    cuts, left = [], total
    while left:
        n = draw(st.integers(1, left))
        cuts.append(n)
        left -= n
    return cuts


@settings(max_examples=60, deadline=None)
@given(splits())
def test_digest_ignores_batch_boundaries(cuts):
    assert digest(TABLE, cuts) == digest(TABLE, [TABLE.num_rows])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, TABLE.num_rows - 1), st.integers(0, 4))
def test_digest_sees_every_change(row, col):
    """Changing one value (or dropping a row) changes the digest."""
    changed = TABLE.to_pylist()
    name = TABLE.column_names[col]
    value = changed[row][name]
    changed[row][name] = {
        "i": 99 if value is None else None,
        "s": "changed",
        "f": -1.0,
        "b": value is not True,
        "t": 12345 if value is None else None,
    }[name]
    other = pa.Table.from_pylist(changed, schema=TABLE.schema)
    assert digest(other, [TABLE.num_rows]) != digest(TABLE, [TABLE.num_rows])
    assert digest(TABLE.slice(1), [TABLE.num_rows - 1]) != digest(TABLE, [TABLE.num_rows])

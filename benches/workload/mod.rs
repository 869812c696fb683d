//! Python toma's own benchmark workload, shared by `chunked_fill` and `side_by_side`: fill a
//! tensor with 1.0 in chunks of 32 rows, by hand and through `toma::execute::chunked`.

use tch::Tensor;

/// Rows per chunk, as in Python toma's benchmark.
pub const ROWS: i64 = 32;

/// The hand-written loop: `narrow` and `fill_`, chunk by chunk.
pub fn native(t: &Tensor) {
    let rows = t.size()[0];
    let mut start = 0;
    while start < rows {
        let len = ROWS.min(rows - start);
        let _ = t.narrow(0, start, len).fill_(1.0);
        start += len;
    }
}

/// The same through toma.
pub fn with_toma(t: &Tensor) {
    toma::execute::chunked(t, ROWS as usize, |mut chunk, _, _| {
        let _ = chunk.fill_(1.0);
        Ok::<(), tch::TchError>(())
    })
    .unwrap();
}

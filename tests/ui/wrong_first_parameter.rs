#[toma::batch(initial_batchsize = 8)]
fn no_parameters() -> usize {
    1
}

#[toma::batch(initial_batchsize = 8)]
fn wrong_type(items: &[f32], batchsize: usize) -> usize {
    items.len() + batchsize
}

#[toma::range(initial_step = 8)]
fn missing_end(start: usize) {
    let _ = start;
}

#[toma::chunked(initial_step = 8)]
fn not_a_tensor(chunk: Vec<f32>, start: usize, end: usize) {
    let _ = (chunk, start, end);
}

fn main() {}

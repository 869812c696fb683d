#[toma::batch(initial_batchsize = "64")]
fn a(batchsize: usize) -> usize {
    batchsize
}

#[toma::batch(initial_batchsize = 64, cache = Forever)]
fn b(batchsize: usize) -> usize {
    batchsize
}

#[toma::batch(initial_batchsize = 64, initial_batchsize = 32)]
fn c(batchsize: usize) -> usize {
    batchsize
}

#[toma::chunked(initial_step = 8, dimension = 1.5)]
fn d(chunk: Tensor, start: usize, end: usize) {
    let _ = (chunk, start, end);
}

struct Tensor;

fn main() {}

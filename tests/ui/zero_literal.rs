#[toma::batch(initial_batchsize = 0)]
fn f(batchsize: usize) -> usize {
    batchsize
}

#[toma::range(initial_step = 0)]
fn g(start: usize, end: usize) {
    let _ = (start, end);
}

fn main() {}

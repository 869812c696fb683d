#[toma::batch]
fn f(batchsize: usize) -> usize {
    batchsize
}

#[toma::range(cache = Global)]
fn g(start: usize, end: usize) {
    let _ = (start, end);
}

fn main() {}

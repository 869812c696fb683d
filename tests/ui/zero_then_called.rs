// A bad argument is one error at the attribute, not one more at every call: the function keeps
// the signature it will have once the argument is fixed.
#[toma::batch(initial_batchsize = 0)]
fn f(batchsize: usize, scale: usize) -> usize {
    batchsize * scale
}

#[toma::range(initial_step = 0)]
fn g(start: usize, end: usize) {
    let _ = (start, end);
}

fn main() {
    let _ = f(3);
    g(0, 10);
}

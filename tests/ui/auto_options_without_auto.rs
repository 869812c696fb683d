// An auto option on a fixed step is a compile error that names the fix.
#[toma::range(initial_step = 64, budget = 1024)]
fn f(start: usize, end: usize) {
    let _ = (start, end);
}

fn main() {}

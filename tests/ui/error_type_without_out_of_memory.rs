#[derive(Debug)]
struct MyError;

#[toma::batch(initial_batchsize = 8)]
fn f(batchsize: usize) -> Result<usize, MyError> {
    Ok(batchsize)
}

fn main() {
    let _ = f();
}

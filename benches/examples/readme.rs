use tessera_cpu::CpuBackend;
use tessera_graph::{Graph, Session};
use tessera_ops::DType;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 1. Build a lazy graph; nothing is computed yet. Shapes are ggml order: ne[0] is innermost.
    let mut g = Graph::new();
    let w = g.parameter("w", DType::F32, [4, 3, 1, 1])?; // weights: 3 rows of K = 4
    let x = g.input("x", DType::F32, [4, 2, 1, 1])?; // activations: 2 columns of K = 4
    let h = g.mul_mat(w, x)?; // [3, 2, 1, 1]: h[m, n] = sum_k w[k, m] * x[k, n]
    let y = g.rms_norm(h, 1e-6)?; // normalise each column of 3 (over ne[0])
    g.mark_output(y)?;

    // 2. Place it on a backend, fill the leaves (logical order, ne[0] fastest), run, read back.
    let mut backend = CpuBackend::new();
    let mut session = Session::new(&g, &mut backend)?;
    session.set_f32(w, &[1., 0., 0., 0., 0., 1., 0., 0., 0., 0., 1., 1.])?;
    session.set_f32(x, &[1., 2., 3., 4., -1., 0., 0., 1.])?;
    session.run()?;
    let out = session.get_f32(y)?;

    // h = [[1, 2, 7], [-1, 0, 1]]; each column divided by its root mean square.
    let (r0, r1) = ((54f32 / 3.).sqrt(), (2f32 / 3.).sqrt());
    let want = [1. / r0, 2. / r0, 7. / r0, -1. / r1, 0., 1. / r1];
    assert!(out.iter().zip(want).all(|(o, w)| (o - w).abs() < 1e-5), "{out:?}");
    println!("{out:?}");
    Ok(())
}

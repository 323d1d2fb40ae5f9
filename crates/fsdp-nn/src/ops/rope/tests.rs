//! Rope against transformers' formula composed from candle ops (values and gradients in every
//! dtype), the other layout, finite differences, each rope scaling, and its refusals.

use candle_core::{DType, Device, Var};

use super::*;

fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let mut rng = crate::rng::XorShift64::seeded(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.next_unit() * 2.0 - 1.0).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// transformers' formula from candle ops: `x * cos + cat(-x2, x1) * sin`.
fn composed(x: &Tensor, table: &RopeTable, positions: &[u32]) -> Result<Tensor> {
    let (_, _, s, d) = x.dims4()?;
    let angles = table.angles_at(positions);
    let (cos, sin) = (angles.cos.to_vec(), angles.sin.to_vec());
    let rows = positions.len() / s;
    let full = |v: Vec<f32>| -> Result<Tensor> {
        let t = Tensor::from_vec(v, (rows, 1, s, d / 2), x.device())?;
        Tensor::cat(&[&t, &t], 3)?.to_dtype(x.dtype())
    };
    let (cos, sin) = (full(cos)?, full(sin)?);
    let (x1, x2) = (x.narrow(3, 0, d / 2)?, x.narrow(3, d / 2, d / 2)?);
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// Value and gradient of `sum(f(x) * w)` at `x`.
fn value_and_grad(f: &dyn Fn(&Tensor) -> Result<Tensor>, x: &Tensor) -> (Vec<f64>, Vec<f64>) {
    let v = Var::from_tensor(x).unwrap();
    let out = f(v.as_tensor()).unwrap();
    let w = rand(out.dims(), 5, out.dtype());
    let grads = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let flat = |t: &Tensor| -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    (flat(&out), flat(grads.get(&v).unwrap()))
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn values_and_gradients_equal_the_composed_formula_in_every_dtype() {
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32.0,
    };
    let table = RopeTable::new(16, 500000.0, Some(scaling)).unwrap();
    let shared: Vec<u32> = (0..6).collect();
    let per_sequence: Vec<u32> = (0..6).chain(40..46).collect();
    for (dtype, tol) in [
        (DType::F64, 1e-6),
        (DType::F32, 1e-5),
        (DType::BF16, 4e-2),
        (DType::F16, 4e-3),
    ] {
        for positions in [&shared, &per_sequence] {
            let x = rand(&[2, 3, 6, 16], 1, dtype);
            let (v, g) = value_and_grad(&|x| rope(x, &table, positions), &x);
            let (cv, cg) = value_and_grad(&|x| composed(x, &table, positions), &x);
            assert!(
                max_diff(&v, &cv) < tol,
                "{dtype:?} values: {}",
                max_diff(&v, &cv)
            );
            assert!(
                max_diff(&g, &cg) < 4.0 * tol,
                "{dtype:?} gradients: {}",
                max_diff(&g, &cg)
            );
            assert_eq!(rope(&x, &table, positions).unwrap().dtype(), dtype);
        }
    }
}

#[test]
fn the_seq_first_layout_equals_the_heads_first_one_transposed() {
    let table = RopeTable::new(8, 10000.0, Some(RopeScaling::Linear { factor: 2.0 })).unwrap();
    for positions in [(0..5).collect::<Vec<u32>>(), (0..5).chain(7..12).collect()] {
        let angles = table.angles_at(&positions);
        let x = rand(&[2, 5, 3, 8], 9, DType::F64);
        let seq_first = |x: &Tensor| rope_with(x, &angles, RopeLayout::SeqFirst);
        let heads_first = |x: &Tensor| {
            let t = x.transpose(1, 2)?.contiguous()?;
            rope_with(&t, &angles, RopeLayout::HeadsFirst)?
                .transpose(1, 2)?
                .contiguous()
        };
        let (v, g) = value_and_grad(&seq_first, &x);
        let (hv, hg) = value_and_grad(&heads_first, &x);
        assert!(max_diff(&v, &hv) < 1e-15 && max_diff(&g, &hg) < 1e-15);
    }
    let angles = table.angles_at(&[0, 1, 2]);
    let err = rope_with(
        &rand(&[1, 4, 2, 8], 1, DType::F32),
        &angles,
        RopeLayout::SeqFirst,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("[batch, seq, heads, head_dim]"),
        "{err}"
    );
}

#[test]
fn the_gradient_matches_finite_differences() {
    let table = RopeTable::new(8, 10000.0, None).unwrap();
    let positions: Vec<u32> = vec![0, 5, 9];
    let x = rand(&[1, 2, 3, 8], 3, DType::F64);
    let w = rand(&[1, 2, 3, 8], 5, DType::F64);
    let loss = |x: &Tensor| -> f64 {
        (rope(x, &table, &positions).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    let (_, g) = value_and_grad(&|x| rope(x, &table, &positions), &x);
    let base: Vec<f64> = x.flatten_all().unwrap().to_vec1().unwrap();
    for i in 0..base.len() {
        let at = |h: f64| {
            let mut v = base.clone();
            v[i] += h;
            loss(&Tensor::from_vec(v, x.dims(), &Device::Cpu).unwrap())
        };
        let numeric = (at(1e-6) - at(-1e-6)) / 2e-6;
        assert!(
            (numeric - g[i]).abs() < 1e-7,
            "element {i}: {numeric} vs {}",
            g[i]
        );
    }
}

#[test]
fn matches_transformers_for_each_rope_scaling() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/rope");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rope.json")).unwrap()).unwrap();
    let tensors =
        candle_core::safetensors::load(dir.join("rope.safetensors"), &Device::Cpu).unwrap();
    let positions: Vec<u32> = doc["positions"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_u64().unwrap() as u32)
        })
        .collect();
    for (name, case) in doc["cases"].as_object().unwrap() {
        let scaling = RopeScaling::from_config(&case["rope_scaling"]).unwrap();
        let head_dim = case["head_dim"].as_u64().unwrap() as usize;
        let table = RopeTable::new(head_dim, case["theta"].as_f64().unwrap(), scaling).unwrap();
        let want: Vec<f32> = tensors[&format!("{name}.inv_freq")].to_vec1().unwrap();
        for (a, b) in table.inv_freq.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{name} inv_freq: {a} vs {b}"
            );
        }
        let out = rope(&tensors[&format!("{name}.q")], &table, &positions).unwrap();
        let got: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
        let want: Vec<f32> = tensors[&format!("{name}.out")]
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Position 7000's angles are large: f32 cos/sin of them differ by a few ulps.
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-5, "{name}: {worst}");
    }
}

#[test]
fn bad_shapes_and_settings_are_errors() {
    let table = RopeTable::new(8, 10000.0, None).unwrap();
    let x = rand(&[2, 2, 3, 8], 1, DType::F32);
    for (x, positions) in [
        (x.clone(), vec![0, 1]),
        (x.reshape((2, 6, 8)).unwrap(), vec![0, 1, 2]),
    ] {
        let e = rope(&x, &table, &positions).unwrap_err().to_string();
        assert!(
            e.contains("rope: x must be [batch, heads, seq, head_dim]"),
            "{e}"
        );
    }
    assert!(RopeTable::new(7, 10000.0, None).is_err());
    let e = RopeScaling::from_config(&serde_json::json!({"rope_type": "yarn", "factor": 4.0}))
        .unwrap_err();
    assert!(e.contains("`yarn` is not supported"), "{e}");
    let e = RopeScaling::from_config(&serde_json::json!({"type": "linear"})).unwrap_err();
    assert!(e.contains("no number `factor`"), "{e}");
    assert_eq!(
        RopeScaling::from_config(&serde_json::json!({"rope_type": "default"})),
        Ok(None)
    );
}

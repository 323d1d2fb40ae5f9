//! Which full parameters backward will read, from the graph before it runs: a unit gathered
//! since its forward releases the others at once, and a unit released after its forward
//! refills only those before its backward. An embedding table is read in forward only (its
//! backward adds the output's gradient into rows by id), and the language model head fused
//! into its loss computed its gradients in forward, so the unit holding a tied word
//! embedding (MiniLM's 47 MB, SmolLM2's 113 MB) holds it through no part of backward.
//!
//! The ops known not to read an input in backward are listed here; every other op input is
//! taken as read. A view (reshape, transpose, permute, narrow, broadcast) shares its input's
//! storage, so a read of the view is a read of the parameter.

use std::collections::{HashMap, HashSet};

use candle_core::op::Op;
use candle_core::{Tensor, TensorId};

/// Custom ops whose backward reads none of their tensor inputs' values (by `name()`): the
/// embedding lookup reads only the ids and the table's shape; the fused head and loss kept
/// its gradients from forward.
const BACKWARD_READS_NO_INPUT: &[&str] = &["embedding", "fused-linear-cross-entropy"];

/// The op's inputs, each with whether its backward reads that input's values, and whether
/// the op's output is a view of its (single) input's storage.
pub(crate) fn inputs(op: &Op) -> (Vec<(&Tensor, bool)>, bool) {
    fn read(ts: Vec<&Tensor>) -> Vec<(&Tensor, bool)> {
        ts.into_iter().map(|t| (t, true)).collect()
    }
    match op {
        Op::Reshape(a)
        | Op::Transpose(a, _, _)
        | Op::Permute(a, _)
        | Op::Narrow(a, _, _, _)
        | Op::Broadcast(a) => (vec![(a, false)], true),
        // Their backward maps the gradient alone; the output is a copy.
        Op::ToDType(a) | Op::Copy(a) | Op::ToDevice(a) | Op::Affine { arg: a, .. } => {
            (vec![(a, false)], false)
        }
        Op::IndexSelect(table, ids, _) => (vec![(table, false), (ids, true)], false),
        Op::CustomOp2(a, b, c) if BACKWARD_READS_NO_INPUT.contains(&c.name()) => {
            (vec![(a, false), (b, false)], false)
        }
        Op::Binary(a, b, _)
        | Op::Matmul(a, b)
        | Op::Gather(a, b, _)
        | Op::SliceScatter0(a, b, _)
        | Op::CustomOp2(a, b, _) => (read(vec![a, b]), false),
        Op::Scatter(a, b, c, _)
        | Op::ScatterAdd(a, b, c, _)
        | Op::IndexAdd(a, b, c, _)
        | Op::WhereCond(a, b, c)
        | Op::CustomOp3(a, b, c, _) => (read(vec![a, b, c]), false),
        Op::Conv1D { arg, kernel, .. }
        | Op::ConvTranspose1D { arg, kernel, .. }
        | Op::Conv2D { arg, kernel, .. }
        | Op::ConvTranspose2D { arg, kernel, .. } => (read(vec![arg, kernel]), false),
        Op::Cat(args, _) => (read(args.iter().collect()), false),
        Op::Unary(a, _)
        | Op::Cmp(a, _)
        | Op::Reduce(a, _, _)
        | Op::Elu(a, _)
        | Op::Powf(a, _)
        | Op::CustomOp1(a, _)
        | Op::AvgPool2D { arg: a, .. }
        | Op::MaxPool2D { arg: a, .. }
        | Op::UpsampleNearest1D { arg: a, .. }
        | Op::UpsampleNearest2D { arg: a, .. }
        | Op::UpsampleBilinear2D { arg: a, .. } => (read(vec![a]), false),
    }
}

/// Of the tensors `watched`, those whose values some backward formula of `sorted`'s graph
/// reads (directly or through a view). `sorted` is `loss.sorted_nodes()`: backward order,
/// so every consumer comes before what it consumes.
pub(crate) fn read_in_backward(
    sorted: &[&Tensor],
    watched: &HashSet<TensorId>,
) -> HashSet<TensorId> {
    // The watched tensor each node is (or is a view of), in forward order.
    let mut storage_of: HashMap<TensorId, TensorId> = watched.iter().map(|&id| (id, id)).collect();
    let mut read = HashSet::new();
    for node in sorted.iter().rev() {
        let Some(op) = node.op() else { continue };
        let (args, view) = inputs(op);
        for (arg, reads) in args {
            let Some(&source) = storage_of.get(&arg.id()) else {
                continue;
            };
            if view {
                storage_of.insert(node.id(), source);
            } else if reads {
                read.insert(source);
            }
        }
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::ops::{CrossEntropy, embedding, linear_cross_entropy};
    use candle_core::{DType, Device, Var};

    /// Whether backward of `loss(w)` reads the parameter `w` [4, 3].
    fn reads(loss: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> bool {
        let dev = Device::Cpu;
        let w = Var::from_vec((0..12).map(|i| i as f32 / 7.0).collect(), (4, 3), &dev).unwrap();
        let loss = loss(w.as_tensor()).unwrap();
        let watched = HashSet::from([w.id()]);
        !read_in_backward(&loss.sorted_nodes(), &watched).is_empty()
    }

    fn ids() -> Tensor {
        Tensor::new(&[3u32, 0, 3], &Device::Cpu).unwrap()
    }

    fn x() -> Tensor {
        Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_lookup_or_the_fused_head_reads_no_table() {
        assert!(!reads(|w| embedding(w, &ids(), None)?.sum_all()));
        assert!(!reads(|w| w.index_select(&ids(), 0)?.sum_all()));
        assert!(!reads(|w| {
            let targets = Tensor::new(&[1u32, 2], &Device::Cpu)?;
            linear_cross_entropy(&x(), w, &targets, CrossEntropy::default())
        }));
    }

    #[test]
    fn a_product_reads_the_weight_through_views() {
        assert!(reads(|w| x().matmul(&w.t()?)?.sum_all()));
        assert!(reads(|w| w.narrow(0, 1, 2)?.mul(&x())?.sum_all()));
        assert!(reads(|w| w
            .reshape((3, 4))?
            .t()?
            .matmul(&x().t()?)?
            .sum_all()));
        assert!(reads(|w| {
            w.broadcast_as((2, 4, 3))?
                .mul(&Tensor::ones((2, 4, 3), DType::F32, &Device::Cpu)?)?
                .sum_all()
        }));
    }

    #[test]
    fn a_copy_is_read_instead_of_the_weight() {
        assert!(!reads(|w| {
            let copy = w.to_dtype(DType::F64)?;
            x().to_dtype(DType::F64)?.matmul(&copy.t()?)?.sum_all()
        }));
        assert!(!reads(|w| x().matmul(&w.t()?.contiguous()?)?.sum_all()));
        assert!(!reads(|w| w.affine(2.0, 1.0)?.sqr()?.sum_all()));
        // Both: the weight itself is also multiplied.
        assert!(reads(
            |w| embedding(w, &ids(), None)?.sum_all()? + w.sqr()?.sum_all()?
        ));
    }
}

//! What the multi-process tests of every backend share: test data whose float sums are exact
//! in every dtype, comparisons, and one check of every collective through the
//! `Communicator` trait, so each backend meets the same expectations.
#![allow(dead_code)]

#[macro_use]
#[path = "../../../fsdp/tests/common/skip.rs"]
pub mod skip;

use fsdp_comm::{Buffer, Communicator, CommunicatorExt, Element, Mesh, ReduceOp};
use half::{bf16, f16};

/// Rank `r`'s value at index `i`: small integers, so float sums are exact in every dtype.
pub fn value(r: usize, i: usize) -> f64 {
    ((r * 7 + i * 3) % 5) as f64
}

/// An element type the tests fill from f64 values.
pub trait TestElement: Element + fsdp_comm::BufferElement + std::fmt::Debug {
    fn from_f64(v: f64) -> Self;
}

macro_rules! test_element {
    ($t:ty, |$v:ident| $conv:expr) => {
        impl TestElement for $t {
            fn from_f64($v: f64) -> Self {
                $conv
            }
        }
    };
}
test_element!(f32, |v| v as f32);
test_element!(f64, |v| v);
test_element!(f16, |v| f16::from_f64(v));
test_element!(bf16, |v| bf16::from_f64(v));
test_element!(i32, |v| v as i32);
test_element!(i64, |v| v as i64);
test_element!(u8, |v| v as u8);

pub fn data<T: TestElement>(r: usize, n: usize) -> Vec<T> {
    data_from(r, 0, n)
}

/// Elements `start..start + n` of rank `r`'s data.
pub fn data_from<T: TestElement>(r: usize, start: usize, n: usize) -> Vec<T> {
    (start..start + n)
        .map(|i| T::from_f64(value(r, i)))
        .collect()
}

pub fn expect_eq<T: TestElement>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    match got
        .iter()
        .zip(want)
        .position(|(a, b)| a.partial_cmp(b) != Some(std::cmp::Ordering::Equal))
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i}: got {:?}, want {:?}",
            got[i], want[i]
        )),
    }
}

fn typed<T: TestElement>(b: Buffer) -> Result<Vec<T>, String> {
    b.into_vec::<T>()
        .map_err(|b| format!("result holds {:?}, not {:?}", b.dtype(), T::DTYPE))
}

/// Every collective of the trait on `len`-element inputs of `T` for each of `sizes`,
/// against results computed here: all-reduce with each op, all-gather, reduce-scatter,
/// broadcast, gather and scatter from the last rank, barrier.
pub fn check_collectives<T: TestElement>(
    c: &dyn Communicator,
    name: &str,
    sizes: &[usize],
) -> Result<(), String> {
    let (rank, n) = (c.rank(), c.size());
    let err = |e: fsdp_comm::CommError| e.to_string();
    for &len in sizes {
        let ctx = |op: &str| format!("{op} {name} x {len}");
        let all: Vec<Vec<T>> = (0..n).map(|r| data::<T>(r, len)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let got = c
                .all_reduce_vec(data::<T>(rank, len), op)
                .wait()
                .map_err(err)?;
            let mut want = all[0].clone();
            for other in &all[1..] {
                fsdp_comm::reduce_into(&mut want, other, op);
            }
            fsdp_comm::finish_avg(&mut want, op, n);
            expect_eq(&ctx(&format!("all_reduce {op:?}")), &got, &want)?;
        }
        let got = c.all_gather_vec(data::<T>(rank, len)).wait().map_err(err)?;
        expect_eq(&ctx("all_gather"), &got, &all.concat())?;

        // Rank r's input of n blocks is data(r, len * n); only this rank's block of each is
        // needed to check the result (materialising all would cost n^2 blocks).
        let my_block_of = |r: usize| data_from::<T>(r, rank * len, len);
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let got = c
                .reduce_scatter(T::into_buffer(data::<T>(rank, len * n)), op)
                .wait()
                .map_err(err)
                .and_then(typed::<T>)?;
            let mut want = my_block_of(0);
            for r in 1..n {
                fsdp_comm::reduce_into(&mut want, &my_block_of(r), op);
            }
            fsdp_comm::finish_avg(&mut want, op, n);
            expect_eq(&ctx(&format!("reduce_scatter {op:?}")), &got, &want)?;
        }
        // All-to-all: this rank gets block `rank` of every rank's input, in rank order.
        let got = c
            .all_to_all(T::into_buffer(data::<T>(rank, len * n)))
            .wait()
            .map_err(err)
            .and_then(typed::<T>)?;
        let want: Vec<T> = (0..n).flat_map(my_block_of).collect();
        expect_eq(&ctx("all_to_all"), &got, &want)?;

        let root = n - 1;
        let got = c
            .broadcast_vec(data::<T>(rank, len), root)
            .wait()
            .map_err(err)?;
        expect_eq(&ctx("broadcast"), &got, &all[root])?;
        let got = c.gather_vec(data::<T>(rank, len), 0).wait().map_err(err)?;
        if rank == 0 {
            expect_eq(
                &ctx("gather"),
                &got.ok_or("gather gave root nothing")?,
                &all.concat(),
            )?;
        }
        let input = if rank == root {
            data::<T>(root, len * n)
        } else {
            Vec::new()
        };
        let got = c
            .scatter(T::into_buffer(input), len, root)
            .wait()
            .map_err(err)
            .and_then(typed::<T>)?;
        expect_eq(&ctx("scatter"), &got, &my_block_of(root))?;
        c.barrier().wait().map_err(err)?;
    }
    Ok(())
}

/// [`check_collectives`] for every element type.
pub fn check_every_dtype(c: &dyn Communicator, sizes: &[usize]) -> Result<(), String> {
    check_collectives::<f32>(c, "f32", sizes)?;
    check_collectives::<f64>(c, "f64", sizes)?;
    check_collectives::<f16>(c, "f16", sizes)?;
    check_collectives::<bf16>(c, "bf16", sizes)?;
    check_collectives::<i32>(c, "i32", sizes)?;
    check_collectives::<i64>(c, "i64", sizes)?;
    check_collectives::<u8>(c, "u8", sizes)
}

/// The hybrid mesh of `c` (replicas of 2 shards): its shape, an all-reduce over both
/// dimensions, and the broadcast from its first rank.
pub fn check_hybrid_mesh(c: &dyn Communicator) -> Result<(), String> {
    let err = |e: fsdp_comm::CommError| e.to_string();
    let (rank, n) = (c.rank(), c.size());
    let mesh = Mesh::hybrid(c, 2).map_err(err)?;
    if (mesh.shard_size(), mesh.replicas(), mesh.rank()) != (2, n / 2, rank) {
        return Err(format!(
            "mesh shape {:?}",
            (mesh.shard_size(), mesh.replicas(), mesh.rank())
        ));
    }
    let total = mesh
        .all_reduce(Buffer::from(vec![rank as f64]), ReduceOp::Sum)
        .map_err(err)?;
    expect_eq(
        "mesh all_reduce",
        total.as_slice::<f64>().ok_or("dtype")?,
        &[(0..n).sum::<usize>() as f64],
    )?;
    let first = mesh
        .broadcast_from_first(Buffer::from(vec![rank as i32 + 10]))
        .map_err(err)?;
    expect_eq(
        "mesh broadcast",
        first.as_slice::<i32>().ok_or("dtype")?,
        &[10],
    )
}

/// Two-hop collectives over machines of `machine` consecutive ranks of `c` against their
/// definitions: the all-gather of f32 and of bytes equal to the flat one bit for bit, the
/// reduce-scatter (sums of small integers, exact) equal to its definition, and an
/// all-to-all through each machine's sum equal to it too — all of them in flight at once,
/// for lengths from nothing to more than a page.
pub fn check_two_hops(c: &dyn Communicator, machine: usize) -> Result<(), String> {
    let err = |e: fsdp_comm::CommError| e.to_string();
    let (rank, n) = (c.rank(), c.size());
    let hops = fsdp_comm::TwoHops::new(c, machine).map_err(err)?;
    if (hops.machine_size(), hops.machines()) != (machine, n / machine) {
        return Err(format!(
            "two hops over {} x {}",
            hops.machine_size(),
            hops.machines()
        ));
    }
    let machines = n / machine;
    for len in [0usize, 1, 5, 1000] {
        let gathered = hops.all_gather(Buffer::from(data::<f32>(rank, len)));
        let bytes = hops.all_gather(Buffer::from(data::<u8>(rank, len)));
        let summed = hops.reduce_scatter(Buffer::from(data::<f64>(rank, len * n)), ReduceOp::Sum);
        // What a machine's processes sent this one: [process][machine][len], summed over
        // processes into one part per machine.
        let through = hops.all_to_all_through(Buffer::from(data::<f64>(rank, len * n)), move |b| {
            let v = b.as_slice::<f64>().unwrap_or(&[]).to_vec();
            let mut parts = vec![0f64; machines * len];
            for process in v.chunks(machines * len.max(1)).take(machine) {
                for (p, x) in parts.iter_mut().zip(process) {
                    *p += x;
                }
            }
            Ok(Buffer::from(parts))
        });
        let want_gathered: Vec<f32> = (0..n).flat_map(|r| data::<f32>(r, len)).collect();
        let want_bytes: Vec<u8> = (0..n).flat_map(|r| data::<u8>(r, len)).collect();
        let want_sum: Vec<f64> = (rank * len..(rank + 1) * len)
            .map(|i| (0..n).map(|r| value(r, i)).sum())
            .collect();
        let ctx = |what: &str| format!("two hops ({machine} per machine) {what} of {len}");
        expect_eq(
            &ctx("all_gather"),
            &typed::<f32>(gathered.wait().map_err(err)?)?,
            &want_gathered,
        )?;
        expect_eq(
            &ctx("u8 all_gather"),
            &typed::<u8>(bytes.wait().map_err(err)?)?,
            &want_bytes,
        )?;
        expect_eq(
            &ctx("reduce_scatter"),
            &typed::<f64>(summed.wait().map_err(err)?)?,
            &want_sum,
        )?;
        let from_machines = typed::<f64>(through.wait().map_err(err)?)?;
        let mut got = vec![0f64; len];
        for part in from_machines.chunks(len.max(1)).take(machines) {
            for (g, x) in got.iter_mut().zip(part) {
                *g += x;
            }
        }
        if from_machines.len() != machines * len {
            return Err(format!(
                "{}: {} elements",
                ctx("all_to_all_through"),
                from_machines.len()
            ));
        }
        expect_eq(&ctx("all_to_all_through"), &got, &want_sum)?;
    }
    // Across machines each member sent its own f32 and u8 inputs once per other machine,
    // plus its machine's sums of the reductions.
    let (_, across) = hops.bytes_sent();
    let inputs: u64 = [0u64, 1, 5, 1000].iter().map(|l| l * 5).sum();
    let reductions: u64 = [0u64, 1, 5, 1000].iter().map(|l| l * 8 * 2).sum();
    let want = (machines as u64 - 1) * (inputs + reductions);
    if machines > 1 && across != want {
        return Err(format!(
            "two hops sent {across} bytes across machines, want {want}"
        ));
    }
    Ok(())
}

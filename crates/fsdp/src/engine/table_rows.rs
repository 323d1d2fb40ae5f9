//! Row lookups of a sharded embedding table with a row-sparse gradient
//! ([`crate::nn::Embedding::sparse`]): forward gathers only the rows some rank of the shard
//! group looks up, never the whole table (a batch of a few hundred tokens reads a few hundred
//! of a vocabulary's tens of thousands of rows).
//!
//! Every rank of the shard group takes part in each exchange, in the same order (they run the
//! same forward): an all-gather of how many rows each still needs, then — unless none needs
//! any — an all-gather of those rows' ids, padded to the largest count, whose union every rank
//! forms alike; then an all-gather in which each rank contributes the union's rows it owns,
//! padded to the largest such count. Every rank ends with the union's rows, so which rows a
//! table holds is the same on every rank, and a later lookup asks only for new ones.

use fsdp_comm::{Buffer, CommError, Communicator, CommunicatorExt, DType};

use super::plan::ShardLayout;

/// The union's rows after an exchange: `placed[k] = (row of the table, row of `values`)`.
pub(crate) struct ExchangedRows {
    pub placed: Vec<(usize, usize)>,
    pub values: Buffer,
}

/// The rows among `ids` that `held` does not mark, and those every other rank of `group`
/// wants, from their owners; `owned` is this rank's unpadded rows of table `layout` (f32
/// master values), sent as `dtype`. `None` when no rank wants any. An id outside the table
/// on any rank fails the exchange on every rank.
pub(crate) fn exchange(
    group: &dyn Communicator,
    layout: &ShardLayout,
    (ids, held): (&[i64], &[bool]),
    owned: &[f32],
    dtype: DType,
) -> Result<Option<ExchangedRows>, CommError> {
    let invalid = |reason: String| CommError::InvalidArgument {
        rank: group.global_rank(),
        op: format!("the row lookup of `{}`", layout.name),
        reason,
    };
    let wanted = wanted(ids, held);
    let count = wanted.as_ref().map_or(-1, |w| w.len() as i64);
    let counts = group.all_gather_vec(vec![count]).wait()?;
    let wanted = wanted.map_err(invalid)?;
    let outside: Vec<usize> = (0..counts.len()).filter(|&r| counts[r] < 0).collect();
    if !outside.is_empty() {
        let rows = held.len();
        return Err(invalid(format!(
            "rank(s) {outside:?} of the shard group looked up ids outside the table's {rows} rows"
        )));
    }
    let most = counts.iter().copied().max().unwrap_or(0) as usize;
    if most == 0 {
        return Ok(None);
    }
    let mut ids: Vec<i64> = wanted.iter().map(|&r| r as i64).collect();
    ids.resize(most, -1);
    let mut union: Vec<usize> = group
        .all_gather_vec(ids)
        .wait()?
        .into_iter()
        .filter_map(|id| usize::try_from(id).ok())
        .collect();
    union.sort_unstable();
    union.dedup();
    // Each rank's share of the union: the rows it owns, in order (owners hold ascending
    // ranges, so the shares in rank order are the union in order).
    let shares: Vec<&[usize]> = (0..group.size())
        .map(|r| {
            let (start, end) = layout.rows_of(r);
            let from = union.partition_point(|&id| id < start);
            let to = union.partition_point(|&id| id < end);
            &union[from..to]
        })
        .collect();
    let widest = shares.iter().map(|s| s.len()).max().unwrap_or(0);
    let row = layout.row_elems;
    let (start, _) = layout.rows_of(group.rank());
    let mut mine = vec![0.0f32; widest * row];
    for (k, &id) in shares[group.rank()].iter().enumerate() {
        let at = (id - start) * row;
        mine[k * row..(k + 1) * row].copy_from_slice(&owned[at..at + row]);
    }
    let sent = super::cpu_floats::float_buffer(&mine, dtype)
        .ok_or_else(|| invalid(format!("rows cannot be sent as {dtype:?}")))?;
    let values = group.all_gather(sent).wait()?;
    let placed = shares
        .iter()
        .enumerate()
        .flat_map(|(r, share)| {
            share
                .iter()
                .enumerate()
                .map(move |(k, &id)| (id, r * widest + k))
        })
        .collect();
    Ok(Some(ExchangedRows { placed, values }))
}

/// The distinct rows among `ids` that `held` does not mark, sorted; an id outside the table
/// (`held.len()` rows) is an error naming it.
pub(crate) fn wanted(ids: &[i64], held: &[bool]) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for &id in ids {
        let row = usize::try_from(id)
            .ok()
            .filter(|&r| r < held.len())
            .ok_or_else(|| format!("id {id} is outside the table's {} rows", held.len()))?;
        if !held[row] {
            out.push(row);
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use fsdp_comm::LocalGroup;

    use super::*;

    fn layout(rows: usize, ranks: usize, row_elems: usize) -> ShardLayout {
        ShardLayout {
            name: "t.weight".into(),
            shape: vec![rows, row_elems],
            requires_grad: true,
            sparse_grad: true,
            rows_per_rank: rows.div_ceil(ranks),
            row_elems,
            offset: 0,
            packing: None,
        }
    }

    /// `f` run by each member of a group of `ranks` threads; their results in rank order.
    fn on_ranks<T: Send + 'static>(
        ranks: usize,
        f: impl Fn(&LocalGroup) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let handles: Vec<_> = LocalGroup::create(ranks)
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(&g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Rank `r` wants the rows in `wants[r]`; every rank gets the union's rows, each the
    /// table's own values (row `id` holds `id * 10 + column`).
    #[test]
    fn every_rank_gets_the_union_of_the_rows_asked_for_from_their_owners() {
        for (ranks, rows) in [(2, 9), (3, 10), (4, 5), (3, 2)] {
            let wants: Vec<Vec<i64>> = (0..ranks)
                .map(|r| {
                    (0..rows as i64)
                        .filter(|id| (id * 7 + r as i64) % 3 == 0)
                        .collect()
                })
                .collect();
            let mut union: Vec<usize> = wants.iter().flatten().map(|&id| id as usize).collect();
            union.sort_unstable();
            union.dedup();
            let l = layout(rows, ranks, 2);
            let got = on_ranks(ranks, move |g| {
                let (start, end) = l.rows_of(g.rank());
                let owned: Vec<f32> = (start..end)
                    .flat_map(|id| [id as f32 * 10.0, id as f32 * 10.0 + 1.0])
                    .collect();
                let (want, held) = (&wants[g.rank()], vec![false; rows]);
                exchange(g, &l, (want, &held), &owned, DType::F32).unwrap()
            });
            for got in got {
                let got = got.unwrap();
                let Buffer::F32(values) = &got.values else {
                    panic!("f32 rows")
                };
                let mut ids: Vec<usize> = got.placed.iter().map(|p| p.0).collect();
                ids.sort_unstable();
                assert_eq!(ids, union, "{ranks} ranks, {rows} rows");
                for &(id, at) in &got.placed {
                    let row = [id as f32 * 10.0, id as f32 * 10.0 + 1.0];
                    assert_eq!(values[at * 2..at * 2 + 2], row);
                }
            }
        }
    }

    #[test]
    fn no_collective_but_the_counts_when_nobody_wants_a_row() {
        for (none, sent) in on_ranks(2, |g| {
            let before = g.bytes_sent();
            let nothing = (&[][..], &[false; 4][..]);
            let got = exchange(g, &layout(4, 2, 3), nothing, &[0.0; 6], DType::F32);
            (got.unwrap().is_none(), g.bytes_sent() - before)
        }) {
            assert!(none);
            assert_eq!(sent, 8, "only this rank's count crossed");
        }
    }

    /// An id outside the table on one rank fails the lookup on every rank (none waits for a
    /// collective the others never issue), naming the id where it was looked up.
    #[test]
    fn an_id_outside_the_table_fails_every_rank() {
        let errors = on_ranks(3, |g| {
            let ids = if g.rank() == 1 { vec![2, 7] } else { vec![0] };
            let got = exchange(
                g,
                &layout(6, 3, 1),
                (&ids, &[false; 6]),
                &[0.0; 2],
                DType::F32,
            );
            got.err().map(|e| e.to_string()).unwrap_or_default()
        });
        let named = errors[1].contains("id 7 is outside the table's 6 rows");
        assert!(named, "{errors:?}");
        for e in [&errors[0], &errors[2]] {
            let told = e.contains("rank(s) [1]") && e.contains("`t.weight`");
            assert!(told, "{errors:?}");
        }
    }

    #[test]
    fn wanted_rows_are_distinct_sorted_new_and_inside_the_table() {
        let held = [false, true, false, false];
        assert_eq!(wanted(&[3, 0, 3, 1, 0], &held).unwrap(), vec![0, 3]);
        let e = wanted(&[2, 4], &held).unwrap_err();
        assert!(e.contains("id 4") && e.contains("4 rows"), "{e}");
        assert!(wanted(&[-1], &held).unwrap_err().contains("id -1"));
    }
}

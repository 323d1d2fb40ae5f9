//! [`Communicator`] for [`LocalGroup`]: each collective a round of the members' rendezvous,
//! and `split_2d` from a registry the members share.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Call, LocalGroup, bytes, check, concat, concat_range, reduce_range};
use crate::buffer::Buffer;
use crate::communicator::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Result};
use crate::work::Work;

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn global_rank(&self) -> usize {
        self.rank
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn split_2d(
        &self,
        shard_size: usize,
    ) -> Result<(Arc<dyn Communicator>, Arc<dyn Communicator>)> {
        crate::communicator::check_split(self.rank, self.size, shard_size)?;
        let n = self.splits_made.fetch_add(1, Ordering::SeqCst);
        let mut splits = self.shared.splits.lock().unwrap_or_else(|e| e.into_inner());
        let members = splits.entry((n, shard_size)).or_insert_with(|| {
            // The first member to arrive makes every sub-group; rank = replica × shard size
            // + shard index, as in `ProcessGroup::mesh_2d`.
            let replicas = self.size / shard_size;
            let timeout = self.shared.timeout;
            let mut shards: Vec<Vec<Option<LocalGroup>>> = (0..replicas)
                .map(|_| {
                    LocalGroup::with_timeout(shard_size, timeout)
                        .into_iter()
                        .map(Some)
                        .collect()
                })
                .collect();
            let mut copies: Vec<Vec<Option<LocalGroup>>> = (0..shard_size)
                .map(|_| {
                    LocalGroup::with_timeout(replicas, timeout)
                        .into_iter()
                        .map(Some)
                        .collect()
                })
                .collect();
            (0..self.size)
                .map(|r| {
                    let (replica, shard) = (r / shard_size, r % shard_size);
                    Some((
                        shards[replica][shard].take()?,
                        copies[shard][replica].take()?,
                    ))
                })
                .collect()
        });
        let (shard, replicate) =
            members[self.rank]
                .take()
                .ok_or_else(|| CommError::InvalidArgument {
                    rank: self.rank,
                    op: format!("split_2d({shard_size})"),
                    reason: "this member's sub-groups were already taken".into(),
                })?;
        if members.iter().all(Option::is_none) {
            splits.remove(&(n, shard_size));
        }
        Ok((Arc::new(shard), Arc::new(replicate)))
    }

    fn all_gather(&self, input: Buffer) -> Work<Buffer> {
        let call = Call::AllGather;
        let invalid = check(&input, self.size, call);
        self.submit(call, input, invalid, |m, all| {
            m.same_lengths("all_gather", all)?;
            m.sent(bytes(&all[m.rank]) * (all.len() as f64 - 1.0));
            Ok(concat(all))
        })
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Work<Buffer> {
        self.reduce_scatter_into(input, Buffer::empty(DType::U8), op)
            .map(|(_, mine)| Ok(mine))
    }

    fn all_gather_into(&self, input: Buffer, _output: Buffer) -> Work<(Buffer, Buffer)> {
        let call = Call::AllGather;
        let invalid = check(&input, self.size, call);
        self.submit(call, input, invalid, |m, all| {
            m.same_lengths("all_gather", all)?;
            let n = all.len() as f64;
            m.sent(bytes(&all[m.rank]) * (n - 1.0));
            Ok(((*all[m.rank]).clone(), concat(all)))
        })
    }

    fn reduce_scatter_into(
        &self,
        input: Buffer,
        _output: Buffer,
        op: ReduceOp,
    ) -> Work<(Buffer, Buffer)> {
        let (n, call) = (self.size, Call::ReduceScatter(op));
        let invalid = check(&input, n, call);
        self.submit(call, input, invalid, move |m, all| {
            let len = m.same_lengths("reduce_scatter", all)?;
            let k = len / n;
            m.sent(bytes(&all[m.rank]) * (n as f64 - 1.0) / n as f64);
            let mine = reduce_range(all, m.rank * k..(m.rank + 1) * k, op);
            Ok(((*all[m.rank]).clone(), mine))
        })
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        let (n, call) = (self.size as f64, Call::AllReduce(op));
        let invalid = check(&buf, self.size, call);
        self.submit(call, buf, invalid, move |m, all| {
            let len = m.same_lengths("all_reduce", all)?;
            m.sent(bytes(&all[m.rank]) * 2.0 * (n - 1.0) / n);
            Ok(reduce_range(all, 0..len, op))
        })
    }

    fn all_to_all(&self, input: Buffer) -> Work<Buffer> {
        let (n, call) = (self.size, Call::AllToAll);
        let invalid = check(&input, n, call);
        self.submit(call, input, invalid, move |m, all| {
            let k = m.same_lengths("all_to_all", all)? / n;
            m.sent(bytes(&all[m.rank]) * (n as f64 - 1.0) / n as f64);
            Ok(concat_range(all, m.rank * k..(m.rank + 1) * k))
        })
    }

    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
        let (n, call) = (self.size, Call::Broadcast(root));
        let invalid = check(&buf, n, call);
        self.submit(call, buf, invalid, move |m, all| {
            m.same_lengths("broadcast", all)?;
            if m.rank == root {
                m.sent(bytes(&all[root]) * (n as f64 - 1.0));
            }
            Ok((*all[root]).clone())
        })
    }

    fn gather(&self, input: Buffer, root: usize) -> Work<Option<Buffer>> {
        let call = Call::Gather(root);
        let invalid = check(&input, self.size, call);
        self.submit(call, input, invalid, move |m, all| {
            m.same_lengths("gather", all)?;
            if m.rank != root {
                m.sent(bytes(&all[m.rank]));
            }
            Ok((m.rank == root).then(|| concat(all)))
        })
    }

    fn barrier(&self) -> Work<()> {
        self.submit(Call::Barrier, Buffer::empty(DType::U8), None, |_, _| Ok(()))
    }

    fn join(&self, what: &str, timeout: Duration) -> Result<()> {
        let mine = what.as_bytes().to_vec();
        let named = what.to_string();
        let what = what.to_string();
        self.submit_within(
            Call::Join,
            Buffer::U8(mine),
            None,
            timeout,
            move |m, all| {
                for (peer, theirs) in all.iter().enumerate() {
                    if theirs.as_slice::<u8>() != Some(what.as_bytes()) {
                        let theirs =
                            String::from_utf8_lossy(theirs.as_slice::<u8>().unwrap_or(&[]));
                        return Err(CommError::Mismatch {
                            rank: m.rank,
                            peer,
                            mine: format!("join({what})"),
                            theirs: format!("join({theirs})"),
                        });
                    }
                }
                Ok(())
            },
        )
        .wait()
        .map_err(|e| match e {
            CommError::NotJoined {
                rank,
                missing,
                timeout,
                ..
            } => CommError::NotJoined {
                rank,
                what: named,
                missing,
                timeout,
            },
            other => other,
        })
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }
}

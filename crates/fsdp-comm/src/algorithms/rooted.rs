//! Rooted collectives: broadcast, gather and scatter, the root exchanging with every rank.

use crate::dtype::{Element, as_bytes};
use crate::error::Result;
use crate::protocol::{Engine, Op, Out};

impl Engine {
    /// See [`crate::ProcessGroup::broadcast`].
    pub fn broadcast<T: Element>(&mut self, mut buf: Vec<T>, root: usize) -> Result<Vec<T>> {
        self.check_root("broadcast", root)?;
        let h = self.begin::<T>(Op::Broadcast, buf.len(), None);
        if self.rank == root {
            let outs: Vec<Out> = self
                .others()
                .into_iter()
                .map(|p| (p, 0, as_bytes(&buf)))
                .collect();
            self.transfer(h, &outs, Vec::new())?;
        } else {
            self.transfer(h, &[], vec![Self::into_slice(root, 0, &mut buf)])?;
        }
        Ok(buf)
    }

    /// See [`crate::ProcessGroup::gather`].
    pub fn gather<T: Element>(&mut self, input: Vec<T>, root: usize) -> Result<Option<Vec<T>>> {
        self.check_root("gather", root)?;
        let k = input.len();
        let h = self.begin::<T>(Op::Gather, k * self.size, None);
        if self.rank != root {
            self.transfer(h, &[(root, 0, as_bytes(&input))], Vec::new())?;
            return Ok(None);
        }
        let mut out = vec![T::default(); k * self.size];
        out[root * k..(root + 1) * k].copy_from_slice(&input);
        {
            let mut parts: Vec<&mut [T]> = Vec::with_capacity(self.size);
            let mut rest = out.as_mut_slice();
            for _ in 0..self.size {
                let (part, tail) = rest.split_at_mut(k);
                parts.push(part);
                rest = tail;
            }
            let ins = parts
                .into_iter()
                .enumerate()
                .filter(|(peer, _)| *peer != root)
                .map(|(peer, part)| Self::into_slice(peer, 0, part))
                .collect();
            self.transfer(h, &[], ins)?;
        }
        Ok(Some(out))
    }

    /// See [`crate::ProcessGroup::scatter`].
    pub fn scatter<T: Element>(&mut self, input: Vec<T>, k: usize, root: usize) -> Result<Vec<T>> {
        self.check_root("scatter", root)?;
        if self.rank == root && input.len() != k * self.size {
            return Err(self.invalid(
                "scatter",
                format!(
                    "root input has {} elements, expected {k} x {} ranks",
                    input.len(),
                    self.size
                ),
            ));
        }
        let h = self.begin::<T>(Op::Scatter, k * self.size, None);
        if self.rank == root {
            let outs: Vec<Out> = self
                .others()
                .into_iter()
                .map(|p| (p, 0, as_bytes(&input[p * k..(p + 1) * k])))
                .collect();
            self.transfer(h, &outs, Vec::new())?;
            return Ok(input[root * k..(root + 1) * k].to_vec());
        }
        let mut out = vec![T::default(); k];
        self.transfer(h, &[], vec![Self::into_slice(root, 0, &mut out)])?;
        Ok(out)
    }
}

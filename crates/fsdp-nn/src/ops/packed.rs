//! Sequences of different lengths laid end to end: a right-padded batch without its padding
//! (flash attention's "varlen" layout). A model computes its per-token layers on the real
//! tokens only and attends within each sequence ([`super::varlen_attention`]); dropout draws
//! the padded batch's masks ([`super::dropout_packed`]), so the result is the padded
//! computation's, up to the order of the sums over tokens.

use std::sync::Arc;

use candle_core::{Result, Tensor};

/// Where each sequence of a packed batch lies, and which padded row each packed row was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedSequences {
    /// First packed row of each sequence, then the number of rows.
    starts: Arc<[usize]>,
    /// The padded batch's sequence length.
    padded_len: usize,
    /// For each packed row, its row in the padded `[batch * padded_len]` layout.
    padded_rows: Arc<[u32]>,
}

impl PackedSequences {
    /// Sequences of `lengths` tokens (each at least 1, at most `padded_len`), taken from the
    /// start of each row of a `[lengths.len(), padded_len]` batch.
    pub fn from_lengths(lengths: &[usize], padded_len: usize) -> Result<PackedSequences> {
        if let Some((b, &n)) = lengths
            .iter()
            .enumerate()
            .find(|&(_, &n)| n == 0 || n > padded_len)
        {
            candle_core::bail!(
                "packed sequences: sequence {b} has {n} tokens (must be 1..={padded_len})"
            );
        }
        if lengths.len().saturating_mul(padded_len) > u32::MAX as usize {
            candle_core::bail!(
                "packed sequences: {} rows of {padded_len} exceed u32 row numbers",
                lengths.len()
            );
        }
        let mut starts = Vec::with_capacity(lengths.len() + 1);
        let mut padded_rows = Vec::with_capacity(lengths.iter().sum());
        starts.push(0);
        for (b, &n) in lengths.iter().enumerate() {
            padded_rows.extend((0..n).map(|l| (b * padded_len + l) as u32));
            starts.push(padded_rows.len());
        }
        Ok(PackedSequences {
            starts: starts.into(),
            padded_len,
            padded_rows: padded_rows.into(),
        })
    }

    /// Number of sequences.
    pub fn sequences(&self) -> usize {
        self.starts.len() - 1
    }

    /// Number of packed rows (real tokens).
    pub fn tokens(&self) -> usize {
        self.starts[self.starts.len() - 1]
    }

    /// The padded batch's sequence length.
    pub fn padded_len(&self) -> usize {
        self.padded_len
    }

    /// First packed row of sequence `b`.
    pub fn start(&self, b: usize) -> usize {
        self.starts[b]
    }

    /// Tokens of sequence `b`.
    pub fn len(&self, b: usize) -> usize {
        self.starts[b + 1] - self.starts[b]
    }

    /// Whether there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.sequences() == 0
    }

    /// Each sequence's first packed row, then the number of rows (`sequences() + 1` entries),
    /// as u32 like [`Self::padded_rows`] (what the CUDA kernels read).
    pub fn row_starts(&self) -> Vec<u32> {
        // Rows are numbered in u32 (checked in `from_lengths`).
        self.starts.iter().map(|&s| s as u32).collect()
    }

    /// Each packed row's row in the padded `[batch * padded_len]` layout.
    pub fn padded_rows(&self) -> &[u32] {
        &self.padded_rows
    }

    /// [`Self::padded_rows`], shared.
    pub(crate) fn shared_padded_rows(&self) -> Arc<[u32]> {
        self.padded_rows.clone()
    }

    /// Each token's position inside its sequence.
    pub fn positions(&self) -> Vec<u32> {
        (0..self.sequences())
            .flat_map(|b| 0..self.len(b) as u32)
            .collect()
    }

    /// Packed rows `[tokens, width]` laid back into their padded batch
    /// `[sequences, padded_len, width]`, zeros past each sequence's end (candle ops: gradients
    /// flow back to the rows).
    pub fn pad(&self, rows: &Tensor) -> Result<Tensor> {
        let (tokens, width) = rows.dims2()?;
        if tokens != self.tokens() {
            candle_core::bail!(
                "packed sequences: {tokens} rows for {} tokens",
                self.tokens()
            );
        }
        let mut from = vec![tokens as u32; self.sequences() * self.padded_len];
        for (packed, &row) in self.padded_rows.iter().enumerate() {
            from[row as usize] = packed as u32;
        }
        let from = Tensor::from_vec(from, self.sequences() * self.padded_len, rows.device())?;
        let zero = Tensor::zeros((1, width), rows.dtype(), rows.device())?;
        Tensor::cat(&[rows, &zero], 0)?
            .index_select(&from, 0)?
            .reshape((self.sequences(), self.padded_len, width))
    }

    /// The packed row of each sequence's first token.
    pub fn first_rows(&self) -> Vec<u32> {
        self.starts[..self.sequences()]
            .iter()
            .map(|&s| s as u32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rows_number_the_padded_rows_they_came_from() {
        let p = PackedSequences::from_lengths(&[2, 4, 1], 4).unwrap();
        assert_eq!((p.sequences(), p.tokens(), p.padded_len()), (3, 7, 4));
        assert_eq!(p.padded_rows(), &[0, 1, 4, 5, 6, 7, 8]);
        assert_eq!(p.positions(), vec![0, 1, 0, 1, 2, 3, 0]);
        assert_eq!(p.first_rows(), vec![0, 2, 6]);
        assert_eq!((p.start(1), p.len(1)), (2, 4));
    }

    #[test]
    fn padding_packed_rows_puts_each_row_back_and_zeros_past_the_ends() {
        let p = PackedSequences::from_lengths(&[2, 3], 3).unwrap();
        let rows = Tensor::arange(1f32, 11.0, &candle_core::Device::Cpu)
            .unwrap()
            .reshape((5, 2))
            .unwrap();
        let padded: Vec<Vec<Vec<f32>>> = p.pad(&rows).unwrap().to_vec3().unwrap();
        assert_eq!(
            padded,
            [
                [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]],
                [[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]
            ]
        );
        assert!(p.pad(&rows.narrow(0, 0, 4).unwrap()).is_err());
    }

    #[test]
    fn empty_or_overlong_sequences_are_refused() {
        for lengths in [&[2, 0][..], &[5, 1][..]] {
            let e = PackedSequences::from_lengths(lengths, 4).unwrap_err();
            assert!(e.to_string().contains("must be 1..=4"), "{e}");
        }
    }
}

//! Model FLOPs utilisation of a run, against this CPU's measured peak in the run's compute
//! dtype over every core the job computes on: what the examples print and log. The FLOPs
//! come from the model's [`crate::models::TransformerShape`].

use super::Accelerator;
pub use crate::perf::MfuLine;

impl Accelerator {
    /// A run's MFU line: `flops` the whole job did (and `padded` ones, counting every
    /// position of padded batches) in `seconds`, against the peak of the cores every process
    /// computes on, in the dtype `mixed_precision` computes in. The peak is looked up (once
    /// per CPU it is measured, a few seconds) only where the line is printed, so only the
    /// main process measures.
    ///
    /// ```no_run
    /// # fn report(acc: &fsdp::accelerator::Accelerator, config: &fsdp::models::BertConfig, lengths: Vec<usize>, seconds: f64) {
    /// let flops = config.transformer_shape().training_flops(lengths);
    /// acc.print(acc.mfu_line(flops, None, seconds));
    /// # }
    /// ```
    pub fn mfu_line(&self, flops: f64, padded: Option<f64>, seconds: f64) -> MfuLine {
        crate::perf::mfu_line(
            flops,
            padded,
            seconds,
            self.job_cores(),
            self.compute_dtype(),
        )
    }

    /// The job's peak FLOP/s in the run's compute dtype (every core it computes on), which
    /// a step's MFU divides its FLOP/s by. Measured on first use (a few seconds, once per
    /// CPU; cached when the machine was quiet enough): look it up before training, on the
    /// process that logs.
    pub fn peak_flops(&self) -> f64 {
        let per_core = crate::perf::core_peak().for_dtype(self.compute_dtype());
        self.job_cores() as f64 * per_core
    }

    /// The cores the job computes on: its processes times each one's compute threads.
    fn job_cores(&self) -> usize {
        crate::perf::job_cores(self.num_processes())
    }

    /// The dtype the run's matrix products compute in.
    fn compute_dtype(&self) -> candle_core::DType {
        crate::perf::compute_dtype(self.plugin().mixed_precision)
    }
}

//! Composite modules: what a struct's child fields contribute to the module tree
//! ([`ModuleChildren`]) and `composite_module!`, which implements [`Module`] from them.

use super::module::{Module, ModuleInfo};

/// What a field of a composite module contributes to its node of the module tree: one child
/// for a module, each element for a `Vec` of modules (PyTorch's `nn.ModuleList`: the elements
/// are built with paths such as `blocks.0`, `blocks.1`), nothing for an absent `Option`.
pub trait ModuleChildren {
    /// `node` with this field's modules appended as children, in order.
    fn add_to(&self, node: ModuleInfo) -> ModuleInfo;

    /// This field's modules appended to `out`, mutably, in the same order.
    fn push_mut<'a>(&'a mut self, out: &mut Vec<&'a mut dyn Module>);
}

impl<T: Module> ModuleChildren for T {
    fn add_to(&self, node: ModuleInfo) -> ModuleInfo {
        node.child(self.info())
    }

    fn push_mut<'a>(&'a mut self, out: &mut Vec<&'a mut dyn Module>) {
        out.push(self);
    }
}

impl<T: Module> ModuleChildren for Vec<T> {
    fn add_to(&self, node: ModuleInfo) -> ModuleInfo {
        self.iter().fold(node, |node, m| node.child(m.info()))
    }

    fn push_mut<'a>(&'a mut self, out: &mut Vec<&'a mut dyn Module>) {
        out.extend(self.iter_mut().map(|m| m as &mut dyn Module));
    }
}

impl<T: Module> ModuleChildren for Option<T> {
    fn add_to(&self, node: ModuleInfo) -> ModuleInfo {
        match self {
            Some(m) => node.child(m.info()),
            None => node,
        }
    }

    fn push_mut<'a>(&'a mut self, out: &mut Vec<&'a mut dyn Module>) {
        if let Some(m) = self {
            out.push(m);
        }
    }
}

/// Implements [`Module`] for a struct with a `path: String` field whose subtree is a node of
/// type `$name` over the listed child fields, in order (the way PyTorch registers children).
/// A field may be a module, a `Vec` of modules or an `Option` of one ([`ModuleChildren`]);
/// fields not listed (dropout, sizes, flags) are not part of the tree. A type whose name
/// depends on the instance (one struct serving `LlamaDecoderLayer` and `Qwen2DecoderLayer`)
/// gives a method instead of a literal: `composite_module!(Layer, fn type_name, [...])`, with
/// `fn type_name(&self) -> &'static str`.
///
/// ```
/// use fsdp_nn::composite_module;
/// use fsdp_nn::layers::{LayerNorm, Linear};
/// use fsdp_nn::{Module, join};
///
/// struct Block { path: String, ln: LayerNorm, fc: Linear }
/// composite_module!(Block, "Block", [ln, fc]);
///
/// struct Net { path: String, blocks: Vec<Block> }
/// composite_module!(Net, "Net", [blocks]);
///
/// let block = |i: usize| {
///     let path = join("blocks", &i.to_string());
///     Block { ln: LayerNorm::new(join(&path, "ln"), 8, 1e-5), fc: Linear::new(join(&path, "fc"), 8, 8, 0.02), path }
/// };
/// let net = Net { path: String::new(), blocks: vec![block(0), block(1)] };
/// let names: Vec<String> = net.info().all_params().iter().map(|p| p.name.clone()).collect();
/// assert_eq!(names[..3], ["blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.fc.weight"]);
/// assert_eq!(net.info().modules().len(), 7);   // Net, 2 Blocks, 2 LayerNorms, 2 Linears
/// ```
#[macro_export]
macro_rules! composite_module {
    ($ty:ty, $name:literal, [$($child:ident),* $(,)?]) => {
        impl $crate::Module for $ty {
            fn path(&self) -> &str {
                &self.path
            }

            fn info(&self) -> $crate::ModuleInfo {
                let node = $crate::ModuleInfo::new(self.path.clone(), $name);
                $(let node = $crate::ModuleChildren::add_to(&self.$child, node);)*
                node
            }

            fn children_mut(&mut self) -> Vec<&mut dyn $crate::Module> {
                #[allow(unused_mut)]
                let mut out: Vec<&mut dyn $crate::Module> = Vec::new();
                $($crate::ModuleChildren::push_mut(&mut self.$child, &mut out);)*
                out
            }
        }
    };
    ($ty:ty, fn $name:ident, [$($child:ident),* $(,)?]) => {
        impl $crate::Module for $ty {
            fn path(&self) -> &str {
                &self.path
            }

            fn info(&self) -> $crate::ModuleInfo {
                let node = $crate::ModuleInfo::new(self.path.clone(), self.$name());
                $(let node = $crate::ModuleChildren::add_to(&self.$child, node);)*
                node
            }

            fn children_mut(&mut self) -> Vec<&mut dyn $crate::Module> {
                #[allow(unused_mut)]
                let mut out: Vec<&mut dyn $crate::Module> = Vec::new();
                $($crate::ModuleChildren::push_mut(&mut self.$child, &mut out);)*
                out
            }
        }
    };
}

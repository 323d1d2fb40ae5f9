//! The arena the pickle reader decodes into, and its bounded writing-out as a tree: memo
//! references share arena nodes, so copying them out is what could blow up, and is where
//! the depth and size limits apply.

use super::value::{PickleError, Value, malformed};

/// The deepest nesting a decoded value may have (DCP's metadata nests a handful deep).
const MAX_DEPTH: usize = 256;
/// The most values and string bytes a pickle may decode to, whatever its length: memo
/// references share one object many times, and writing the tree out copies it each time.
const MAX_VALUES: usize = 1 << 25;
/// Values allowed per input byte (beyond a small base): legitimate pickles expand little.
const VALUES_PER_BYTE: usize = 16;

/// A value while decoding: containers hold other nodes by index into the arena, so a memo
/// reference (`GET`) shares a node instead of copying it, and a container memoized before
/// it was filled (as pickle does) is seen filled, as in Python.
#[derive(Debug)]
pub(super) enum Node {
    Leaf(Value),
    Tuple(Vec<usize>),
    List(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Set(Vec<usize>),
    Object {
        class: (String, String),
        args: Vec<usize>,
        state: Option<usize>,
    },
    Persistent(usize),
}

/// `root` of the arena `nodes` written out as a [`Value`] tree: at most [`MAX_DEPTH`]
/// deep, and at most [`VALUES_PER_BYTE`] values and string bytes per byte of the
/// `input_len`-byte pickle (plus a small base; [`MAX_VALUES`] in all). `at` is where the
/// pickle ended, for messages.
pub(super) fn write_out(
    nodes: &[Node],
    root: usize,
    input_len: usize,
    at: usize,
) -> Result<Value, PickleError> {
    let budget = VALUES_PER_BYTE
        .saturating_mul(input_len)
        .saturating_add(4096)
        .min(MAX_VALUES);
    let mut tree = Tree {
        nodes,
        left: budget,
        at,
    };
    tree.expand(root, 0)
}

/// Writes the arena out as a tree of [`Value`]s within the limits.
struct Tree<'a> {
    nodes: &'a [Node],
    /// Values and string bytes still allowed.
    left: usize,
    /// Where the pickle ended (for messages).
    at: usize,
}

impl Tree<'_> {
    fn spend(&mut self, n: usize) -> Result<(), PickleError> {
        self.left = self.left.checked_sub(n).ok_or_else(|| {
            malformed(
                self.at,
                "it expands to more values than its size can hold (shared references repeated)",
            )
        })?;
        Ok(())
    }

    fn all(&mut self, items: &[usize], depth: usize) -> Result<Vec<Value>, PickleError> {
        items.iter().map(|&i| self.expand(i, depth)).collect()
    }

    fn expand(&mut self, node: usize, depth: usize) -> Result<Value, PickleError> {
        if depth > MAX_DEPTH {
            return Err(malformed(
                self.at,
                &format!("nested deeper than {MAX_DEPTH} levels (or refers to itself)"),
            ));
        }
        self.spend(1)?;
        let d = depth + 1;
        Ok(match &self.nodes[node] {
            Node::Leaf(v) => {
                if let Value::Str(s) = v {
                    self.spend(s.len())?;
                }
                if let Value::Bytes(b) = v {
                    self.spend(b.len())?;
                }
                v.clone()
            }
            Node::Tuple(items) => Value::Tuple(self.all(items, d)?),
            Node::List(items) => Value::List(self.all(items, d)?),
            Node::Set(items) => Value::Set(self.all(items, d)?),
            Node::Dict(entries) => Value::Dict(
                entries
                    .iter()
                    .map(|&(k, v)| Ok((self.expand(k, d)?, self.expand(v, d)?)))
                    .collect::<Result<_, PickleError>>()?,
            ),
            Node::Object { class, args, state } => Value::Object {
                class: class.clone(),
                args: self.all(args, d)?,
                state: match state {
                    Some(s) => Some(Box::new(self.expand(*s, d)?)),
                    None => None,
                },
            },
            Node::Persistent(p) => Value::Persistent(Box::new(self.expand(*p, d)?)),
        })
    }
}

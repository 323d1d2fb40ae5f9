//! What the restricted pickle reader decodes to ([`Value`]) and why it may refuse
//! ([`PickleError`]).

/// A decoded pickle value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// Bytes.
    Bytes(Vec<u8>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// A list.
    List(Vec<Value>),
    /// A dict, in insertion order.
    Dict(Vec<(Value, Value)>),
    /// A set or frozenset.
    Set(Vec<Value>),
    /// A reference to an allowed class or function: (module, name).
    Global(String, String),
    /// A call of an allowed global (`REDUCE`, `NEWOBJ`) with its arguments, and the state
    /// `BUILD` gave it.
    Object {
        /// The class or function called: (module, name).
        class: (String, String),
        /// Its arguments.
        args: Vec<Value>,
        /// The state set by `BUILD`.
        state: Option<Box<Value>>,
    },
    /// A persistent id (`BINPERSID`): how torch.save refers to a tensor's storage.
    Persistent(Box<Value>),
}

impl Value {
    /// The entries of a dict or of an object's state dict.
    pub fn fields(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(d) => Some(d),
            Value::Object { state: Some(s), .. } => s.fields(),
            _ => None,
        }
    }

    /// Entry `key` of a dict (or object state) with string keys.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.fields()?
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
            .map(|(_, v)| v)
    }

    /// The integers of a tuple, a list or a `torch.Size`.
    pub fn ints(&self) -> Option<Vec<i64>> {
        match self {
            Value::Tuple(v) | Value::List(v) => v
                .iter()
                .map(|x| match x {
                    Value::Int(i) => Some(*i),
                    _ => None,
                })
                .collect(),
            Value::Object { args, .. } if args.len() == 1 => args[0].ints(),
            Value::Object { args, .. } if args.is_empty() => Some(Vec::new()),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Why a pickle could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PickleError {
    /// The data ends inside an opcode.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// An opcode this reader does not take (it never runs code).
    #[error("opcode 0x{op:02x} at byte {at} is not accepted")]
    Opcode {
        /// The opcode.
        op: u8,
        /// Where.
        at: usize,
    },
    /// A reference to a class or function that is not on the allowed list.
    #[error(
        "refers to `{0}.{1}`, which is not allowed here (a pickle can run code on load; only known data classes are read)"
    )]
    Forbidden(String, String),
    /// The opcodes do not form a valid pickle.
    #[error("malformed at byte {at}: {what}")]
    Malformed {
        /// Where.
        at: usize,
        /// What is wrong.
        what: String,
    },
}

/// A malformed-pickle error at byte `at`.
pub(super) fn malformed(at: usize, what: &str) -> PickleError {
    PickleError::Malformed {
        at,
        what: what.into(),
    }
}

//! [`TensorMap`]: how each unit's flat buffer splits into the model's named tensors (the names
//! and shapes a checkpoint, an export and the model's parameter list share).

/// What is wrong with a tensor map, or with unit lengths held against one; names the unit or the
/// tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TensorMapError(pub String);

/// One named tensor of a unit, row-major, at the next offset of the unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
}

impl NamedTensor {
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        NamedTensor {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    /// Elements of the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Per unit, its tensors in buffer order; validated: every unit non-empty and tiled exactly, names
/// unique across the model (they are the checkpoint's tensor names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMap {
    units: Vec<Vec<NamedTensor>>,
}

impl TensorMap {
    /// `units[u]` lists unit `u`'s tensors.
    pub fn new(units: Vec<Vec<NamedTensor>>) -> Result<Self, TensorMapError> {
        let mut names = std::collections::HashSet::new();
        for (u, tensors) in units.iter().enumerate() {
            if tensors.is_empty() {
                return Err(TensorMapError(format!("unit {u} has no tensors")));
            }
            for t in tensors {
                if t.name.is_empty() || t.name.contains('\0') {
                    return Err(TensorMapError(format!(
                        "unit {u} has a tensor named {:?}",
                        t.name
                    )));
                }
                if !names.insert(t.name.clone()) {
                    return Err(TensorMapError(format!(
                        "tensor name {:?} is used twice",
                        t.name
                    )));
                }
            }
        }
        Ok(TensorMap { units })
    }

    /// One tensor per unit, named `name`, shape `[len]`: for models without finer names.
    pub fn flat(units: &[(String, usize)]) -> Result<Self, TensorMapError> {
        TensorMap::new(
            units
                .iter()
                .map(|(name, len)| vec![NamedTensor::new(name.clone(), &[*len])])
                .collect(),
        )
    }

    /// The units' tensors.
    pub fn units(&self) -> &[Vec<NamedTensor>] {
        &self.units
    }

    /// Elements of unit `u` (the sum of its tensors').
    pub fn unit_len(&self, u: usize) -> usize {
        self.units[u].iter().map(NamedTensor::numel).sum()
    }

    /// Checks that `lens` (one per unit, of `what`) are the map's unit lengths.
    pub fn check_lens(&self, what: &str, lens: &[usize]) -> Result<(), TensorMapError> {
        if lens.len() != self.units.len() {
            return Err(TensorMapError(format!(
                "{what} has {} units, the model {}",
                lens.len(),
                self.units.len()
            )));
        }
        for (u, &len) in lens.iter().enumerate() {
            if len != self.unit_len(u) {
                return Err(TensorMapError(format!(
                    "unit {u} of {what} has {len} elements, the model's tensors {}",
                    self.unit_len(u)
                )));
            }
        }
        Ok(())
    }
}

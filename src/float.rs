//! TEMPORARY stand-in, replaced by the float branch.
#![allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    F8E4M3FN,
    F8E5M2,
}
impl Dtype {
    pub fn size_in_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            _ => 1,
        }
    }
    pub fn is_fp8(self) -> bool {
        matches!(self, Dtype::F8E4M3FN | Dtype::F8E5M2)
    }
}
impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

//! Replication source (placeholder).

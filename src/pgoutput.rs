//! pgoutput decoder (placeholder).

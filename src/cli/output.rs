//! Tables and the JSON result envelope.

//! `toma::lazy` in one process: the API, gradients, ops and plans.
#![cfg(feature = "tch")]
#[path = "../support/mod.rs"]
mod support;

mod api;
mod autocast;
mod card;
mod grad;
mod idioms;
mod machine;
mod models;
mod op_table;
mod ops;
mod pictures;
mod plan;
mod ported_programs;
mod ported_vae;
mod reads;
mod rnn;
mod translation;
mod vision;
mod written_once;
mod zoo_replay;

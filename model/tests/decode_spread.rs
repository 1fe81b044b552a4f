//! The CPU kernels spread a decode step over the cores they are given (the products, and
//! each sequence's attention as an item of its own): every token and logprob is the same
//! bits on two cores as on one, in f32 and with bf16 products, with sequences joining and
//! leaving the batch. A test binary of its own: engines stepping in other tests of the same
//! process would mark cores busy and leave this one a single thread.

use candle_core::Device;
use streamrl_kernels::bf16::Products;
use streamrl_kernels::cores;
use streamrl_model::engine::{Engine, EngineConfig, Output, SamplingParams};
use streamrl_model::{Tokenizer, checkpoint, config};

fn run(products: Products, threads: usize) -> Vec<Output> {
    let tok = Tokenizer::char_level();
    let hf = config::preset("tiny", tok.vocab_size()).unwrap();
    let mut m = checkpoint::init_seeded(&hf, &Device::Cpu, Some(3)).unwrap().model;
    m.set_products(products);
    let mut e = Engine::new(
        m,
        0,
        Some(tok.clone()),
        EngineConfig {
            // Four slots for six requests of unequal lengths: sequences join and leave.
            max_num_seqs: 4,
            cpu_kernels: true,
            ..Default::default()
        },
    );
    for (i, p) in ["1+1=", "123+456=", "7=", "98-76*5=", "31415926+27=", "0*0="]
        .iter()
        .enumerate()
    {
        let params = SamplingParams {
            temperature: 0.8,
            seed: 100 + i as u64,
            max_tokens: 3 + 5 * i,
            ignore_eos: true,
            ..Default::default()
        };
        e.add(tok.encode(p).unwrap(), params).unwrap();
    }
    cores::spread(threads, || {
        assert_eq!(cores::threads(), threads, "nothing else in this process holds a core");
        let mut outs = e.run_to_completion().unwrap();
        outs.sort_by_key(|o| o.id);
        outs
    })
}

#[test]
fn decode_spread_over_two_cores_gives_the_bits_of_one() {
    for products in [Products::F32, Products::Bf16] {
        let (one, two) = (run(products, 1), run(products, 2));
        assert_eq!(one.len(), 6);
        for (a, b) in one.iter().zip(&two) {
            assert_eq!(a.tokens, b.tokens, "{products:?}: request {}", a.id);
            let bits = |o: &Output| o.logprobs.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b), "{products:?}: request {}", a.id);
        }
    }
}

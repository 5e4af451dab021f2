//! The Bradley–Terry reward-model loss: TRL's `RewardTrainer.compute_loss` and OpenRLHF's
//! `PairWiseLoss`, with an optional margin and TRL's reward centring.

use rl_core::shape::Dim;
use tch::{Kind, Tensor};

use crate::check;
use crate::error::{Error, Result};

/// The pairwise (Bradley–Terry) loss averaged over pairs:
/// `mean(-log sigmoid(r_chosen - r_rejected - margin)) + c * mean((r_chosen + r_rejected)^2)`.
///
/// Matches TRL's `RewardTrainer.compute_loss` (`margin` is its dataset column `margin`, `c` its
/// `center_rewards_coefficient`) and OpenRLHF's `PairWiseLoss` (`c = 0`). The loss is at least
/// 0 when `c >= 0`, equals `ln 2` when both rewards are equal and there is no margin, and its
/// gradient raises `r_chosen` and lowers `r_rejected`.
///
/// # Shapes
/// - `chosen_rewards`, `rejected_rewards`: `[pairs]` float, one scalar reward per response
/// - `margin`: `[pairs]` float, the required gap (Llama 2's preference-strength margin)
/// - returns: a scalar in the rewards' dtype
pub fn pairwise_loss(
    chosen_rewards: &Tensor,
    rejected_rewards: &Tensor,
    margin: Option<&Tensor>,
    center_rewards_coefficient: f64,
) -> Result<Tensor> {
    check::float("chosen_rewards", chosen_rewards, &[Dim::Any("pairs")])?;
    check::float_like(
        "rejected_rewards",
        rejected_rewards,
        "chosen_rewards",
        chosen_rewards,
    )?;
    if let Some(m) = margin {
        check::float_like("margin", m, "chosen_rewards", chosen_rewards)?;
    }
    if !center_rewards_coefficient.is_finite() || center_rewards_coefficient < 0.0 {
        return Err(Error::invalid(
            "center_rewards_coefficient",
            format!("must be finite and >= 0, got {center_rewards_coefficient}"),
        ));
    }
    let mut gap = chosen_rewards - rejected_rewards;
    if let Some(m) = margin {
        let kind = gap.kind();
        gap -= m.to_kind(kind);
    }
    let mut loss = (-gap.log_sigmoid()).mean(None::<Kind>);
    if center_rewards_coefficient != 0.0 {
        let center = (chosen_rewards + rejected_rewards)
            .square()
            .mean(None::<Kind>);
        loss += center * center_rewards_coefficient;
    }
    Ok(loss)
}

/// The share of pairs whose chosen reward is strictly above the rejected one (OpenRLHF's
/// `acc`; a tie counts as wrong).
///
/// # Shapes
/// - `chosen_rewards`, `rejected_rewards`: `[pairs]` float
/// - returns: a value in `[0, 1]` (0 for no pairs)
pub fn accuracy(chosen_rewards: &Tensor, rejected_rewards: &Tensor) -> Result<f64> {
    check::float("chosen_rewards", chosen_rewards, &[Dim::Any("pairs")])?;
    check::float_like(
        "rejected_rewards",
        rejected_rewards,
        "chosen_rewards",
        chosen_rewards,
    )?;
    if chosen_rewards.numel() == 0 {
        return Ok(0.0);
    }
    Ok(chosen_rewards
        .gt_tensor(rejected_rewards)
        .to_kind(Kind::Double)
        .mean(Kind::Double)
        .double_value(&[]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(v: &[f64]) -> Tensor {
        Tensor::from_slice(v)
    }

    #[test]
    fn equal_rewards_give_ln2_and_margin_raises_it() {
        let r = t(&[0.3, -1.0, 2.5]);
        let l = pairwise_loss(&r, &r, None, 0.0).unwrap().double_value(&[]);
        assert!((l - std::f64::consts::LN_2).abs() < 1e-12);
        let m = t(&[1.0, 1.0, 1.0]);
        let lm = pairwise_loss(&r, &r, Some(&m), 0.0)
            .unwrap()
            .double_value(&[]);
        assert!((lm - (1.0 + 1f64.exp()).ln()).abs() < 1e-12);
        assert_eq!(accuracy(&r, &r).unwrap(), 0.0);
    }

    #[test]
    fn centring_adds_the_mean_square_of_the_sums() {
        let c = t(&[1.0, 0.0]);
        let r = t(&[1.0, -2.0]);
        let plain = pairwise_loss(&c, &r, None, 0.0).unwrap().double_value(&[]);
        let centred = pairwise_loss(&c, &r, None, 0.01).unwrap().double_value(&[]);
        // sums 2 and -2: mean square 4
        assert!((centred - plain - 0.04).abs() < 1e-12);
    }

    #[test]
    fn bad_inputs_name_the_argument() {
        let c = t(&[1.0, 0.0]);
        let e = pairwise_loss(&c, &t(&[1.0]), None, 0.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rejected_rewards"), "{e}");
        let e = pairwise_loss(&c, &c, None, -1.0).unwrap_err().to_string();
        assert!(e.contains("center_rewards_coefficient"), "{e}");
        let e = pairwise_loss(&c, &c, Some(&t(&[1.0])), 0.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("margin"), "{e}");
    }

    proptest! {
        #[test]
        fn loss_is_nonnegative_and_its_gradient_separates_the_pair(
            pairs in proptest::collection::vec((-20.0f64..20.0, -20.0f64..20.0, 0.0f64..3.0), 1..16),
            centre in 0.0f64..0.1,
        ) {
            let c = t(&pairs.iter().map(|p| p.0).collect::<Vec<_>>()).set_requires_grad(true);
            let r = t(&pairs.iter().map(|p| p.1).collect::<Vec<_>>()).set_requires_grad(true);
            let m = t(&pairs.iter().map(|p| p.2).collect::<Vec<_>>());
            let loss = pairwise_loss(&c, &r, Some(&m), 0.0).unwrap();
            prop_assert!(loss.double_value(&[]) >= 0.0);
            loss.backward();
            let gc = Vec::<f64>::try_from(c.grad()).unwrap();
            let gr = Vec::<f64>::try_from(r.grad()).unwrap();
            for (a, b) in gc.iter().zip(&gr) {
                // descending the loss raises the chosen reward and lowers the rejected one
                prop_assert!(*a <= 0.0 && *b >= 0.0);
                prop_assert!((a + b).abs() < 1e-12);
            }
            let centred = pairwise_loss(&c.detach(), &r.detach(), None, centre).unwrap();
            prop_assert!(centred.double_value(&[]) >= 0.0);
        }
    }
}

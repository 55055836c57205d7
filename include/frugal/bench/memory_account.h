// frugal/bench/memory_account.h — where the training memory of a Transformer stack goes.
//
// Builds `layers` pre-LN blocks on a (batch, seq, width) input (loss = mean of the squared output)
// and measures, with the allocation tracker: parameter, gradient and AdamW-state bytes (formula vs
// real tensors vs tracker), the bytes kept between forward and backward for each checkpointing
// variant, their forward+backward time, and how far their gradients are from the plain run's; and
// the bytes kept without checkpointing with each attention kernel this build has (explicit, and
// sdpa on LibTorch 2.x), each against its formula.
//
//   frugal::bench::AccountConfig cfg;           // 6 layers, width 128, 4 heads, batch 16, seq 64
//   auto result = frugal::bench::run_memory_account(cfg);
//   frugal::bench::write_account_json(result, std::cout);
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "frugal/bench/optim_benchmark.h"
#include "frugal/checkpoint/planner.h"
#include "frugal/io/json.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/attention.h"

namespace frugal {
namespace bench {

// What run_memory_account builds and measures: the stack's shape, the device, the variants and budgets.
struct AccountConfig {
  int64_t layers = 6;
  int64_t width = 128;
  int64_t heads = 4;
  int64_t batch = 16;
  int64_t seq = 64;
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
  bool timing = true;
  int timing_warmup = 2;
  int timing_runs = 7;
  std::vector<std::string> variants = {"none", "full", "every_2", "selective"};
  // Activation budgets for the planner, in bytes and as fractions of the plain run's activation
  // peak; each gets a plan that is then run and measured.
  std::vector<int64_t> budget_bytes;
  std::vector<double> budget_fractions;
  // Also compare a training step with AdamW after backward against AdamW inside it.
  bool optimizer_modes = true;
  // Attention kernels measured without checkpointing; the first must be explicit (the variants
  // run with it, and it is the reference of the others' gradients).
  std::vector<models::AttentionKernel> attentions = models::available_attention_kernels();
};

// "layers must be >= 1, got 0" style message for the first bad field, or empty when valid.
std::string validate(const AccountConfig& config);

// One byte count found three ways: from the formula, summed over the tensors, and from the tracker.
struct BytesCheck {
  int64_t formula = 0;  // from the sizes
  int64_t tensors = 0;  // summed over the real tensors
  int64_t tracked = 0;  // live bytes of the category in the allocation tracker
  // True when the formula, the tensors and the tracker give the same count.
  bool agree() const { return formula == tensors && tensors == tracked; }
};

// One checkpointing variant: bytes kept for backward, time, and gradient gap from the plain run.
struct VariantResult {
  std::string name;
  int64_t saved_bytes = 0;       // live between end of forward and start of backward
  std::optional<double> time_s;  // median forward+backward
  double max_grad_diff = 0;      // against the "none" variant, over every parameter
};

// One attention kernel, no checkpointing. For explicit these are the "none" variant's figures.
struct AttentionResult {
  models::AttentionKernel kernel = models::AttentionKernel::explicit_softmax;
  int64_t saved_bytes = 0;                 // live between end of forward and start of backward
  int64_t predicted_saved_bytes = 0;       // models::predicted_saved_bytes with this kernel
  std::optional<double> time_s;            // median forward+backward
  double max_grad_diff = 0;                // against the explicit kernel, over every parameter
  double measured_over_predicted() const;  // saved_bytes / predicted_saved_bytes (0 when nothing was predicted)
};

// One activation budget: the planner's plan for it, and what running that plan measured.
struct BudgetResult {
  int64_t budget_bytes = 0;
  bool feasible = false;
  int64_t min_achievable_bytes = 0;   // the least budget any plan meets
  checkpoint::ActivationPlan plan;    // when feasible
  checkpoint::ActivationPlan sqrt_n;  // Chen et al.'s rule on the same costs, for comparison
  int64_t measured_bytes = 0;         // activation peak over forward+backward, from the tracker
  std::optional<double> time_s;       // median forward+backward with the plan
  double max_grad_diff = 0;
};

// Everything run_memory_account measured, in the order of its config.
struct AccountResult {
  AccountConfig config;
  int64_t n_params = 0;
  int64_t n_params_formula = 0;
  BytesCheck param_bytes, grad_bytes, adamw_state_bytes;
  std::vector<VariantResult> variants;  // in config.variants order; the first is the reference
  int64_t predicted_saved_bytes_none = 0;
  int64_t activation_peak_none = 0;         // measured activation peak of the plain run
  int64_t planner_predicted_none = 0;       // the planner's prediction of it
  std::vector<BudgetResult> budgets;        // in budget_bytes then budget_fractions order
  std::vector<AttentionResult> attentions;  // in config.attentions order
  std::optional<OptimInBackwardResult> optimizer_modes;
  std::shared_ptr<memory::Tracker> tracker;  // the measured steps' allocation timeline

  const VariantResult* find(const std::string& name) const;  // the variant called `name`, or nullptr
  double max_grad_diff() const;                              // the largest max_grad_diff over the variants
  double measured_over_predicted() const;                    // needs a "none" variant
};

// An infeasible budget stops the measurement early: the result then holds only `budgets` (with
// feasible = false and min_achievable_bytes) and the byte checks. Progress lines ("measuring full") go to `progress` when given.
AccountResult run_memory_account(const AccountConfig& config, const std::function<void(const std::string&)>& progress = {});

void write_account_json(const AccountResult& result, std::ostream& out);
// One budget's plan, prediction and measurement as a JSON object.
void write_budget_json(io::JsonWriter& w, const BudgetResult& budget, const AccountResult& result);

}  // namespace bench
}  // namespace frugal

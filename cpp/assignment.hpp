// The assignment behind node-wise placement (assignment.cpp), also used by greedy_stay
// (movement.cpp) to put whole batches where most of their tokens already are.
#pragma once

#include <cstdint>
#include <vector>

namespace orch {

struct AssignmentResult {
    std::vector<int64_t> col_of;  // column per row, -1 = unmatched
    // An upper bound on the total profit of any assignment (LP duality with the column
    // prices the search reached); equal to the profit found when every search finished.
    int64_t bound = 0;
};

// Maximum-profit assignment of rows to columns, each column taking at most `capacity` rows,
// over a sparse set of positive-profit edges (CSR: row r has edges indptr[r]..indptr[r+1]).
// A row may also stay unmatched (col -1) at profit 0; because every profit is positive and
// the caller has rows <= num_cols * capacity, any unmatched row can later fill any free slot,
// so this is exactly the dense assignment problem with each column repeated `capacity` times.
//
// max_settled > 0 bounds each row's search to that many settled columns; a row whose search
// would go further stays unmatched. The result is then feasible but may fall short of the
// optimum: `bound` says by how much at most (below). Counting columns, not time, keeps it
// deterministic.
AssignmentResult capacitated_assignment(const int64_t* indptr, const int64_t* cols,
                                        const int64_t* profit, int64_t num_rows,
                                        int64_t num_cols, int64_t capacity,
                                        int64_t max_settled);

}  // namespace orch

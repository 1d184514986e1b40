"""attnkit.theory: modules that reproduce results about attention (in-context learning, attention
as an SVM, universal approximation, Hopfield capacity, scaling laws)."""

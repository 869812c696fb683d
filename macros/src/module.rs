//! `#[toma::lazy::module]` on a custom layer's `impl Module for X { fn forward(&self, xs:
//! &Tensor) -> Tensor { .. } }` (or `impl ModuleT` with `forward_t(&self, xs: &Tensor, train:
//! bool)`): the one body serves tch's trait and toma's lazy one. The body is emitted twice,
//! once with `xs: &Tensor` and once with `xs: &LazyTensor`; tch's tensor methods have the same
//! names on both, so it type-checks for each (a `Tensor` named in a type annotation inside the
//! body does not, and the compiler says where).

use proc_macro2::TokenStream as TokenStream2;
use quote::quote;
use syn::{FnArg, ImplItem, ItemImpl, Pat, ReturnType};

pub(crate) fn expand(args: TokenStream2, item: TokenStream2) -> syn::Result<TokenStream2> {
    if !args.is_empty() {
        return Err(syn::Error::new_spanned(args, "#[toma::lazy::module] takes no arguments"));
    }
    let block: ItemImpl = syn::parse2(item)?;
    let usage =
        "#[toma::lazy::module] goes on `impl Module for X { fn forward(&self, xs: &Tensor) -> Tensor { .. } }` \
                 or `impl ModuleT for X { fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor { .. } }`";
    if block.trait_.is_none() {
        return Err(syn::Error::new_spanned(&block.self_ty, usage));
    }
    let fns: Vec<_> = block
        .items
        .iter()
        .filter_map(|i| match i {
            ImplItem::Fn(f) => Some(f),
            _ => None,
        })
        .collect();
    let [f] = fns.as_slice() else {
        return Err(syn::Error::new_spanned(&block.self_ty, usage));
    };
    let train = match f.sig.ident.to_string().as_str() {
        "forward" => false,
        "forward_t" => true,
        _ => return Err(syn::Error::new_spanned(&f.sig.ident, usage)),
    };
    let args: Vec<&FnArg> = f.sig.inputs.iter().collect();
    let expected = if train { 3 } else { 2 };
    if args.len() != expected
        || !matches!(args[0], FnArg::Receiver(r) if r.reference.is_some() && r.mutability.is_none())
        || matches!(f.sig.output, ReturnType::Default)
    {
        return Err(syn::Error::new_spanned(&f.sig, usage));
    }
    let ident = |arg: &FnArg| match arg {
        FnArg::Typed(t) => match &*t.pat {
            Pat::Ident(p) => Ok(p.ident.clone()),
            other => Err(syn::Error::new_spanned(other, "a plain name is expected here")),
        },
        FnArg::Receiver(r) => Err(syn::Error::new_spanned(r, usage)),
    };
    let xs = ident(args[1])?;
    // tch's impl is written with the types and trait as the user wrote them, so that their
    // imports (`use tch::Tensor`, `use toma::lazy::nn::ModuleT`) are used, as without the
    // attribute.
    let ty_of = |arg: &FnArg| match arg {
        FnArg::Typed(t) => Ok(t.ty.clone()),
        FnArg::Receiver(r) => Err(syn::Error::new_spanned(r, usage)),
    };
    let xs_ty = ty_of(args[1])?;
    let output = &f.sig.output;
    let trait_path = &block.trait_.as_ref().expect("checked above").1;
    let uses = quote! {
        const _: () = {
            #[allow(dead_code)]
            fn the_trait_as_written<M: ?::std::marker::Sized + #trait_path>() {}
        };
    };
    let body = &f.block;
    let attrs = &f.attrs;
    let (impl_generics, _, where_clause) = block.generics.split_for_impl();
    let ty = &block.self_ty;
    let lazy = quote!(::toma::lazy::LazyTensor);
    let error = quote!(::toma::lazy::LazyError);
    Ok(if train {
        let flag = ident(args[2])?;
        let flag_ty = ty_of(args[2])?;
        quote! {
            #uses

            impl #impl_generics ::tch::nn::ModuleT for #ty #where_clause {
                #(#attrs)*
                fn forward_t(&self, #xs: #xs_ty, #flag: #flag_ty) #output #body
            }

            impl #impl_generics ::toma::lazy::nn::LazyModuleT for #ty #where_clause {
                #[allow(clippy::redundant_closure_call)]
                fn lazy_forward_t(&self, #xs: &#lazy, #flag: bool) -> ::std::result::Result<#lazy, #error> {
                    ::std::result::Result::Ok((|| -> #lazy #body)())
                }

                fn eager_forward_t(&self, xs: &::tch::Tensor, train: bool) -> ::std::option::Option<::tch::Tensor> {
                    ::std::option::Option::Some(::tch::nn::ModuleT::forward_t(self, xs, train))
                }
            }
        }
    } else {
        quote! {
            #uses

            impl #impl_generics ::tch::nn::Module for #ty #where_clause {
                #(#attrs)*
                fn forward(&self, #xs: #xs_ty) #output #body
            }

            impl #impl_generics ::toma::lazy::nn::LazyModule for #ty #where_clause {
                #[allow(clippy::redundant_closure_call)]
                fn lazy_forward(&self, #xs: &#lazy) -> ::std::result::Result<#lazy, #error> {
                    ::std::result::Result::Ok((|| -> #lazy #body)())
                }

                fn eager_forward(&self, xs: &::tch::Tensor) -> ::std::option::Option<::tch::Tensor> {
                    ::std::option::Option::Some(::tch::nn::Module::forward(self, xs))
                }
            }
        }
    })
}

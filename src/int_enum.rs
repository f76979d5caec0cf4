//! `int_enum!`: an enum whose variants stand for fixed integers (a C constant, a wire value, a
//! verbs number) declared once with its conversions both ways, so the two directions are one
//! list and cannot disagree. Below every layer (the verbs layer included, as `error` is): it is
//! a macro of the language, not a part of the engine.
//!
//! - `int_enum! { pub enum E: i32 { A = 0, B = 1 } }` declares `#[repr(i32)] enum E` (`e as
//!   i32` gives the value) and `E::from_int(v: i32) -> Option<E>`, `Some` for exactly the
//!   listed values. What an unlisted value means (an error, a default) is the caller's to say.
//! - `int_enum! { pub enum E: u32, else Other { A = 0, B = 4 } }` adds a variant `Other(u32)`
//!   for every unlisted value: `E::from_int(v) -> E` and `e.to_int() -> u32` are total.

/// See the module documentation.
macro_rules! int_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant = $value ),+
        }

        impl $name {
            /// The variant standing for `v`, if one does.
            #[allow(dead_code)]
            $vis const fn from_int(v: $repr) -> Option<$name> {
                match v {
                    $( $value => Some($name::$variant), )+
                    _ => None,
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident, else $other:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// Any other value.
            $other($repr),
        }

        impl $name {
            /// The variant standing for `v` (`Other(v)` for a value not listed).
            #[allow(dead_code)]
            $vis const fn from_int(v: $repr) -> $name {
                match v {
                    $( $value => $name::$variant, )+
                    other => $name::$other(other),
                }
            }

            /// The value this variant stands for.
            #[allow(dead_code)]
            $vis const fn to_int(self) -> $repr {
                match self {
                    $( $name::$variant => $value, )+
                    $name::$other(v) => v,
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    int_enum! {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Fixed: i32 { Zero = 0, Two = 2 }
    }

    int_enum! {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Open: u32, else Other {
            Zero = 0,
            Nine = 9,
        }
    }

    #[test]
    fn both_directions_come_from_one_list() {
        assert_eq!(Fixed::from_int(2), Some(Fixed::Two));
        assert_eq!(Fixed::from_int(1), None);
        assert_eq!(Fixed::Two as i32, 2);
        assert_eq!(Open::from_int(9), Open::Nine);
        assert_eq!(Open::from_int(7), Open::Other(7));
        for v in [0, 7, 9, u32::MAX] {
            assert_eq!(Open::from_int(v).to_int(), v);
        }
    }
}
